//! KV block allocation with prefix caching.
//!
//! The KV pool is `num_blocks` blocks of `block_size` token slots each. A sequence's KV lives in
//! the blocks its [`SeqBlocks`] lists, in order: token `t` of the sequence is slot
//! `t % block_size` of block `blocks[t / block_size]`. The caller owns every `SeqBlocks`; the
//! manager keeps only per-block state: a reference count, a place in the free list, and the
//! cache entry of a block whose content is known.
//!
//! Prefix caching: once a block is full and its KV written ([`BlockManager::commit`]), it is
//! entered in the cache under its content — its token ids and the identity of the block before
//! it, so an entry stands for the whole token prefix up to the block's end. A later sequence whose
//! tokens start the same way takes those blocks instead of computing them again
//! ([`BlockManager::acquire_prefix`]). A freed block keeps its content until it is taken for
//! another sequence: free blocks form one list, blocks with no cached content first, then cached
//! blocks from least to most recently freed; [`BlockManager::allocate`] takes from the front,
//! dropping the cache entry of a cached block it takes.
//!
//! Exactness: the cache is found through a 64-bit hash, but a lookup compares the stored token
//! ids and the stored parent identity in full, so a hash collision costs a miss, never a block
//! with other content. Parent identities are entry numbers that are never reused (not hashes), so
//! two different prefixes can never pass for one another.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use crate::{Error, Result};

/// A block of the KV pool: `0..num_blocks`.
pub type BlockId = u32;

const OP: &str = "BlockManager";
/// The end of a linked list.
const NIL: BlockId = BlockId::MAX;
/// The parent identity of a sequence's first block. Cache entries are numbered from 1.
const ROOT: u64 = 0;

/// [`BlockManager::allocate`] found fewer free blocks than it needed (and changed nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("out of KV blocks: {needed} more needed, {free} free")]
pub struct OutOfBlocks {
    /// Blocks the sequence lacked.
    pub needed: usize,
    /// Free blocks there were.
    pub free: usize,
}

/// Prefix-cache counters, in tokens (as vLLM counts them): `queries` is the length of every
/// prompt looked up, `hits` the tokens found cached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    pub queries: u64,
    pub hits: u64,
}

impl PrefixStats {
    /// `hits / queries` (0 before any query).
    pub fn hit_rate(&self) -> f64 {
        if self.queries == 0 {
            0.0
        } else {
            self.hits as f64 / self.queries as f64
        }
    }
}

/// The blocks of one sequence, owned by the caller. It belongs to the [`BlockManager`] that
/// filled it and goes back to it through [`BlockManager::free`] (it is not `Clone`, so a block
/// reference cannot be dropped twice).
#[derive(Debug, Default)]
pub struct SeqBlocks {
    blocks: Vec<BlockId>,
    /// The cache identity of the content of `blocks[i]` for each full block the manager has seen
    /// (taken from the cache or committed): `chain.len() <= blocks.len()`. A block computed again
    /// while an identical one was cached carries that one's identity, so the blocks after it
    /// still chain to the cached prefix.
    chain: Vec<u64>,
}

impl SeqBlocks {
    pub fn new() -> SeqBlocks {
        SeqBlocks::default()
    }

    /// The sequence's blocks in token order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Token slots the blocks hold.
    pub fn capacity(&self, block_size: usize) -> usize {
        self.blocks.len().saturating_mul(block_size)
    }

    /// Full blocks whose content is known to the cache (taken from it or committed); the tokens
    /// of these blocks need no commit again.
    pub fn num_committed_blocks(&self) -> usize {
        self.chain.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// The cache entry of a block whose content is known.
struct Cached {
    hash: u64,
    /// This content's identity (unique over the manager's life).
    entry: u64,
    /// The identity of the block before it, or [`ROOT`].
    parent: u64,
    tokens: Box<[u32]>,
    /// The next block in the same hash bucket.
    bucket_next: BlockId,
}

/// The hash of a block's content: its parent's identity and its token ids.
fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// The KV pool's blocks: reference counts, the free list, the prefix cache (see the module docs).
pub struct BlockManager {
    block_size: usize,
    prefix_caching: bool,
    /// Sequences holding each block; 0 ⇔ the block is in the free list.
    refs: Vec<u32>,
    /// Free-list links (index-linked, so a block leaves the list in O(1) on a cache hit).
    prev: Vec<BlockId>,
    next: Vec<BlockId>,
    head: BlockId,
    tail: BlockId,
    num_free: usize,
    cached: Vec<Option<Cached>>,
    num_cached: usize,
    /// Hash → the first block of its bucket (chained through `Cached::bucket_next`).
    buckets: HashMap<u64, BlockId>,
    next_entry: u64,
    stats: PrefixStats,
    hash: fn(u64, &[u32]) -> u64,
}

impl BlockManager {
    /// A pool of `num_blocks` free blocks of `block_size` slots (both at least 1; block ids must
    /// fit a `u32` below `u32::MAX`).
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Result<BlockManager> {
        let bad = |msg: String| Error::Config { op: OP, msg };
        if num_blocks == 0 {
            return Err(bad("num_blocks must be at least 1, got 0".into()));
        }
        if block_size == 0 {
            return Err(bad("block_size must be at least 1, got 0".into()));
        }
        if num_blocks > NIL as usize {
            return Err(bad(format!(
                "num_blocks {num_blocks} does not fit a u32 block id (at most {NIL})"
            )));
        }
        let fail = |what: &str| bad(format!("cannot allocate {what} for {num_blocks} blocks"));
        let mut refs = Vec::new();
        refs.try_reserve_exact(num_blocks)
            .map_err(|_| fail("reference counts"))?;
        refs.resize(num_blocks, 0);
        let mut prev = Vec::new();
        prev.try_reserve_exact(num_blocks)
            .map_err(|_| fail("free-list links"))?;
        let mut next = Vec::new();
        next.try_reserve_exact(num_blocks)
            .map_err(|_| fail("free-list links"))?;
        let mut cached = Vec::new();
        cached
            .try_reserve_exact(num_blocks)
            .map_err(|_| fail("cache entries"))?;
        let last = num_blocks - 1;
        for b in 0..num_blocks {
            prev.push(if b == 0 { NIL } else { (b - 1) as BlockId });
            next.push(if b == last { NIL } else { (b + 1) as BlockId });
            cached.push(None);
        }
        Ok(BlockManager {
            block_size,
            prefix_caching,
            refs,
            prev,
            next,
            head: 0,
            tail: last as BlockId,
            num_free: num_blocks,
            cached,
            num_cached: 0,
            buckets: HashMap::new(),
            next_entry: ROOT + 1,
            stats: PrefixStats::default(),
            hash: block_hash,
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// Blocks no sequence holds (cached-but-free blocks count as free).
    pub fn num_free_blocks(&self) -> usize {
        self.num_free
    }

    /// Blocks some sequence holds.
    pub fn num_used_blocks(&self) -> usize {
        self.num_blocks() - self.num_free
    }

    /// Blocks whose content is in the prefix cache, used or free.
    pub fn num_cached_blocks(&self) -> usize {
        self.num_cached
    }

    /// Used blocks / all blocks.
    pub fn usage(&self) -> f64 {
        self.num_used_blocks() as f64 / self.num_blocks() as f64
    }

    pub fn prefix_stats(&self) -> PrefixStats {
        self.stats
    }

    /// Takes the longest cached prefix of `tokens`, in whole blocks, into `seq` (which must be
    /// empty: otherwise this returns 0 and counts nothing), leaving at least one token to compute:
    /// at most `(tokens.len() - 1) / block_size` blocks. Each block found gets a reference (and
    /// leaves the free list). Returns the tokens covered. Counts `tokens.len()` queries and the
    /// returned tokens as hits. With prefix caching off: 0, nothing counted.
    pub fn acquire_prefix(&mut self, seq: &mut SeqBlocks, tokens: &[u32]) -> usize {
        if !self.prefix_caching || !seq.blocks.is_empty() || !seq.chain.is_empty() {
            return 0;
        }
        self.stats.queries = self.stats.queries.saturating_add(tokens.len() as u64);
        let max_blocks = tokens.len().saturating_sub(1) / self.block_size;
        let mut parent = ROOT;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let Some((b, entry)) = self.find(parent, chunk) else {
                break;
            };
            let i = b as usize;
            let Some(r) = self.refs[i].checked_add(1) else {
                break;
            };
            if self.refs[i] == 0 {
                self.unlink(b);
            }
            self.refs[i] = r;
            seq.blocks.push(b);
            seq.chain.push(entry);
            parent = entry;
        }
        // At most max_blocks * block_size <= tokens.len(): no overflow.
        let covered = seq.blocks.len() * self.block_size;
        self.stats.hits = self.stats.hits.saturating_add(covered as u64);
        covered
    }

    /// Makes `seq` hold at least `num_slots` slots, taking blocks from the front of the free list
    /// (uncached blocks first, then the least recently freed cached ones, whose cache entries are
    /// dropped). All or nothing: with too few free blocks nothing changes.
    pub fn allocate(
        &mut self,
        seq: &mut SeqBlocks,
        num_slots: usize,
    ) -> std::result::Result<(), OutOfBlocks> {
        let want = num_slots.div_ceil(self.block_size);
        let needed = want.saturating_sub(seq.blocks.len());
        if needed > self.num_free {
            return Err(OutOfBlocks {
                needed,
                free: self.num_free,
            });
        }
        seq.blocks.reserve(needed);
        for _ in 0..needed {
            let b = self.head;
            self.unlink(b);
            self.uncache(b);
            self.refs[b as usize] = 1;
            seq.blocks.push(b);
        }
        Ok(())
    }

    /// Records that the KV of `tokens[..num_computed]` is in `seq`'s blocks: each block of `seq`
    /// that this makes full enters the cache, chained to the block before it (a no-op with
    /// prefix caching off). If an identical block is cached already (another sequence computed
    /// it at the same time), that entry stays and `seq` keeps its own block, uncached.
    /// `tokens` must be the sequence's tokens from its start, as given to
    /// [`BlockManager::acquire_prefix`].
    pub fn commit(&mut self, seq: &mut SeqBlocks, tokens: &[u32], num_computed: usize) {
        if !self.prefix_caching {
            return;
        }
        let full = (num_computed.min(tokens.len()) / self.block_size).min(seq.blocks.len());
        while seq.chain.len() < full {
            let i = seq.chain.len();
            let Some(chunk) = tokens.chunks_exact(self.block_size).nth(i) else {
                return;
            };
            let parent = seq.chain.last().copied().unwrap_or(ROOT);
            if let Some((_, entry)) = self.find(parent, chunk) {
                seq.chain.push(entry);
                continue;
            }
            let b = seq.blocks[i];
            // A block of this manager that the sequence holds, not cached yet: anything else is
            // a `SeqBlocks` from elsewhere, and nothing of it is entered.
            let held = self.refs.get(b as usize).is_some_and(|&r| r > 0);
            if !held || self.cached[b as usize].is_some() {
                return;
            }
            let Some(after) = self.next_entry.checked_add(1) else {
                return;
            };
            let entry = self.next_entry;
            self.next_entry = after;
            let hash = (self.hash)(parent, chunk);
            let bucket_next = self.buckets.insert(hash, b).unwrap_or(NIL);
            self.cached[b as usize] = Some(Cached {
                hash,
                entry,
                parent,
                tokens: chunk.into(),
                bucket_next,
            });
            self.num_cached += 1;
            seq.chain.push(entry);
        }
    }

    /// Drops `seq`'s references. Blocks no sequence holds any more become free: cached ones go
    /// to the back of the free list in reverse order (the sequence's last blocks are evicted
    /// first, so a shared prefix lasts longest), uncached ones to the front. Cached content
    /// stays findable until the block is taken again.
    pub fn free(&mut self, seq: SeqBlocks) {
        for &b in seq.blocks.iter().rev() {
            // Ids this manager did not hand out are skipped.
            let Some(r) = self.refs.get_mut(b as usize) else {
                continue;
            };
            if *r == 0 {
                continue;
            }
            *r -= 1;
            if *r == 0 {
                if self.cached[b as usize].is_some() {
                    self.push_back(b);
                } else {
                    self.push_front(b);
                }
            }
        }
    }

    /// Forgets every cached block. Refused (false, nothing changed) while a cached block is in
    /// use. The counters of [`BlockManager::prefix_stats`] are kept.
    pub fn reset_prefix_cache(&mut self) -> bool {
        let in_use = self
            .refs
            .iter()
            .zip(&self.cached)
            .any(|(&r, c)| r > 0 && c.is_some());
        if in_use {
            return false;
        }
        self.cached.iter_mut().for_each(|c| *c = None);
        self.buckets.clear();
        self.num_cached = 0;
        true
    }

    /// The cached block holding `tokens` after the content `parent`, and its identity.
    fn find(&self, parent: u64, tokens: &[u32]) -> Option<(BlockId, u64)> {
        let hash = (self.hash)(parent, tokens);
        let mut b = *self.buckets.get(&hash)?;
        while b != NIL {
            let c = self.cached[b as usize].as_ref()?;
            if c.parent == parent && *c.tokens == *tokens {
                return Some((b, c.entry));
            }
            b = c.bucket_next;
        }
        None
    }

    /// Drops `b`'s cache entry, if it has one.
    fn uncache(&mut self, b: BlockId) {
        let Some(c) = self.cached[b as usize].take() else {
            return;
        };
        self.num_cached -= 1;
        let Some(&first) = self.buckets.get(&c.hash) else {
            return;
        };
        if first == b {
            if c.bucket_next == NIL {
                self.buckets.remove(&c.hash);
            } else {
                self.buckets.insert(c.hash, c.bucket_next);
            }
            return;
        }
        let mut p = first;
        while p != NIL {
            let Some(pc) = self.cached[p as usize].as_mut() else {
                return;
            };
            if pc.bucket_next == b {
                pc.bucket_next = c.bucket_next;
                return;
            }
            p = pc.bucket_next;
        }
    }

    fn unlink(&mut self, b: BlockId) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
        self.num_free -= 1;
    }

    fn push_back(&mut self, b: BlockId) {
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.num_free += 1;
    }

    fn push_front(&mut self, b: BlockId) {
        self.next[b as usize] = self.head;
        self.prev[b as usize] = NIL;
        if self.head == NIL {
            self.tail = b;
        } else {
            self.prev[self.head as usize] = b;
        }
        self.head = b;
        self.num_free += 1;
    }
}

#[cfg(test)]
mod tests;
