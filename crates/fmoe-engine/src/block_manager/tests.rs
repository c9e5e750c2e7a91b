use std::cell::Cell;
use std::collections::HashSet;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use super::*;

impl BlockManager {
    /// Every hash collides: lookups must tell blocks apart by their stored content alone.
    fn with_colliding_hashes(mut self) -> BlockManager {
        self.hash = |_, _| 42;
        self
    }

    /// The manager's own invariants: the free list holds exactly the blocks of reference count
    /// 0, linked both ways; the counters match; every cached block is in the bucket of its hash.
    fn check(&self) -> std::result::Result<(), String> {
        let n = self.num_blocks();
        let mut seen = vec![false; n];
        let (mut b, mut prev, mut len) = (self.head, NIL, 0usize);
        while b != NIL {
            let i = b as usize;
            if i >= n || seen[i] {
                return Err(format!("free list revisits or leaves the pool at {b}"));
            }
            seen[i] = true;
            if self.prev[i] != prev {
                return Err(format!("block {b}: prev {} != {prev}", self.prev[i]));
            }
            if self.refs[i] != 0 {
                return Err(format!(
                    "block {b} is free with {} references",
                    self.refs[i]
                ));
            }
            len += 1;
            prev = b;
            b = self.next[i];
        }
        if self.tail != prev {
            return Err(format!("tail {} != last of the list {prev}", self.tail));
        }
        if len != self.num_free {
            return Err(format!("list of {len} blocks, num_free {}", self.num_free));
        }
        if let Some(i) = (0..n).find(|&i| self.refs[i] == 0 && !seen[i]) {
            return Err(format!(
                "block {i} has no references and is not in the free list"
            ));
        }
        let cached = self.cached.iter().filter(|c| c.is_some()).count();
        if cached != self.num_cached {
            return Err(format!("{cached} cached, num_cached {}", self.num_cached));
        }
        let mut in_buckets = 0;
        for (&h, &first) in &self.buckets {
            let mut b = first;
            while b != NIL {
                let c = self.cached[b as usize]
                    .as_ref()
                    .ok_or(format!("bucket {h} holds uncached block {b}"))?;
                if c.hash != h {
                    return Err(format!("block {b} of hash {} in bucket {h}", c.hash));
                }
                in_buckets += 1;
                b = c.bucket_next;
            }
        }
        if in_buckets != cached {
            return Err(format!("{in_buckets} blocks in buckets, {cached} cached"));
        }
        Ok(())
    }
}

fn toks(n: u32) -> Vec<u32> {
    (100..100 + n).collect()
}

#[test]
fn bad_pool_shapes_are_errors() {
    let err = |n, bs| BlockManager::new(n, bs, true).err().unwrap().to_string();
    assert!(err(0, 16).contains("num_blocks must be at least 1, got 0"));
    assert!(err(4, 0).contains("block_size must be at least 1, got 0"));
    let m = BlockManager::new(3, 16, true).unwrap();
    assert_eq!(
        (m.num_blocks(), m.block_size(), m.num_free_blocks()),
        (3, 16, 3)
    );
    assert_eq!(m.usage(), 0.0);
}

#[test]
fn allocate_is_all_or_nothing() {
    let mut m = BlockManager::new(4, 4, true).unwrap();
    let mut a = SeqBlocks::new();
    m.allocate(&mut a, 5).unwrap();
    assert_eq!(a.blocks(), &[0, 1]);
    assert_eq!(a.capacity(4), 8);
    // Already enough slots: nothing taken.
    m.allocate(&mut a, 8).unwrap();
    assert_eq!(a.blocks().len(), 2);
    let mut b = SeqBlocks::new();
    assert_eq!(
        m.allocate(&mut b, 12),
        Err(OutOfBlocks { needed: 3, free: 2 })
    );
    assert!(b.is_empty());
    assert_eq!(m.num_free_blocks(), 2);
    m.allocate(&mut a, 16).unwrap();
    assert_eq!((m.num_used_blocks(), m.num_free_blocks()), (4, 0));
    assert_eq!(m.usage(), 1.0);
    assert_eq!(
        m.allocate(&mut b, 1),
        Err(OutOfBlocks { needed: 1, free: 0 })
    );
    m.free(a);
    assert_eq!(m.num_free_blocks(), 4);
    m.check().unwrap();
}

#[test]
fn a_computed_prefix_is_found_again_whole_blocks_only() {
    let mut m = BlockManager::new(8, 4, true).unwrap();
    let t = toks(10);
    let mut a = SeqBlocks::new();
    assert_eq!(m.acquire_prefix(&mut a, &t), 0);
    m.allocate(&mut a, t.len()).unwrap();
    m.commit(&mut a, &t, 10);
    assert_eq!(a.num_committed_blocks(), 2);
    assert_eq!(m.num_cached_blocks(), 2);
    let a_blocks = a.blocks().to_vec();
    m.free(a);

    // The same 10 tokens: the two full blocks.
    let mut b = SeqBlocks::new();
    assert_eq!(m.acquire_prefix(&mut b, &t), 8);
    assert_eq!(b.blocks(), &a_blocks[..2]);
    assert_eq!(m.num_used_blocks(), 2);
    // Exactly 8 tokens: one block, so that a token is left to compute.
    let mut c = SeqBlocks::new();
    assert_eq!(m.acquire_prefix(&mut c, &t[..8]), 4);
    assert_eq!(c.blocks(), &a_blocks[..1]);
    // The first block shared by b and c: still used after one of them goes.
    m.free(b);
    assert_eq!(m.num_used_blocks(), 1);
    m.free(c);
    assert_eq!(m.num_used_blocks(), 0);
    // Diverging in the second block: one block.
    let mut d = SeqBlocks::new();
    let mut u = t.clone();
    u[6] = 0;
    assert_eq!(m.acquire_prefix(&mut d, &u), 4);
    m.free(d);
    // Queries and hits in tokens: 10 + 8 + 10 + 10 queried, 0 + 8 + 4 + 4 hit.
    assert_eq!(
        m.prefix_stats(),
        PrefixStats {
            queries: 38,
            hits: 16
        }
    );
    assert!((m.prefix_stats().hit_rate() - 16.0 / 38.0).abs() < 1e-12);
    m.check().unwrap();
}

#[test]
fn a_block_is_found_only_after_the_same_prefix() {
    for colliding in [false, true] {
        let mut m = BlockManager::new(8, 2, true).unwrap();
        if colliding {
            m = m.with_colliding_hashes();
        }
        let a_tokens = [1, 2, 7, 7, 9];
        let mut a = SeqBlocks::new();
        m.allocate(&mut a, 5).unwrap();
        m.commit(&mut a, &a_tokens, 5);
        // Second block [7, 7] after [3, 4]: not A's second block, whose KV followed [1, 2].
        let b_tokens = [3, 4, 7, 7, 9];
        let mut b = SeqBlocks::new();
        assert_eq!(
            m.acquire_prefix(&mut b, &b_tokens),
            0,
            "colliding {colliding}"
        );
        m.allocate(&mut b, 5).unwrap();
        m.commit(&mut b, &b_tokens, 5);
        assert_eq!(m.num_cached_blocks(), 4);
        // Both chains are found whole, each with its own blocks.
        for (t, s) in [(a_tokens, &a), (b_tokens, &b)] {
            let mut c = SeqBlocks::new();
            assert_eq!(m.acquire_prefix(&mut c, &t), 4, "colliding {colliding}");
            assert_eq!(c.blocks(), &s.blocks()[..2]);
            m.free(c);
        }
        // Tokens that hash alike (all do here, when colliding) but differ: no hit.
        let mut c = SeqBlocks::new();
        assert_eq!(m.acquire_prefix(&mut c, &[1, 3, 7]), 0);
        m.check().unwrap();
        m.free(a);
        m.free(b);
        m.check().unwrap();
    }
}

#[test]
fn free_blocks_are_taken_uncached_first_then_least_recently_freed() {
    // Three blocks of 2: A fills all of them and commits 6 tokens (three cached blocks).
    let mut m = BlockManager::new(3, 2, true).unwrap();
    let t = toks(7);
    let mut a = SeqBlocks::new();
    m.allocate(&mut a, 6).unwrap();
    m.commit(&mut a, &t, 6);
    assert_eq!(m.num_cached_blocks(), 3);
    let ab = a.blocks().to_vec();
    m.free(a);
    // The tail block goes first.
    let mut z = SeqBlocks::new();
    m.allocate(&mut z, 1).unwrap();
    assert_eq!(z.blocks(), &[ab[2]]);
    assert_eq!(m.num_cached_blocks(), 2);
    // Its entry is gone; the first two blocks are still found.
    let mut b = SeqBlocks::new();
    assert_eq!(m.acquire_prefix(&mut b, &t), 4);
    assert_eq!(b.blocks(), &ab[..2]);
    m.free(b);
    // z's block holds nothing cached: freed, it is taken before the cached ones.
    m.free(z);
    let mut y = SeqBlocks::new();
    m.allocate(&mut y, 2).unwrap();
    assert_eq!(y.blocks(), &[ab[2]]);
    m.free(y);
    m.check().unwrap();

    // Last freed is evicted last: C holds block 0 (shared prefix) and frees after A's
    // remaining block 1, so block 1 is evicted before block 0.
    let mut c = SeqBlocks::new();
    assert_eq!(m.acquire_prefix(&mut c, &t[..3]), 2);
    let mut d = SeqBlocks::new();
    assert_eq!(m.acquire_prefix(&mut d, &t[..5]), 4);
    m.free(d);
    m.free(c);
    let mut e = SeqBlocks::new();
    m.allocate(&mut e, 4).unwrap();
    assert_eq!(e.blocks(), &[ab[2], ab[1]]);
    assert_eq!(m.num_cached_blocks(), 1);
    m.check().unwrap();
}

#[test]
fn a_hit_takes_the_block_out_of_the_free_list() {
    let mut m = BlockManager::new(2, 2, true).unwrap();
    let t = [5, 6, 7];
    let mut a = SeqBlocks::new();
    m.allocate(&mut a, 3).unwrap();
    m.commit(&mut a, &t, 3);
    m.free(a);
    let mut b = SeqBlocks::new();
    assert_eq!(m.acquire_prefix(&mut b, &t), 2);
    assert_eq!(m.num_free_blocks(), 1);
    // Only the other block can be allocated.
    let mut c = SeqBlocks::new();
    assert_eq!(
        m.allocate(&mut c, 4),
        Err(OutOfBlocks { needed: 2, free: 1 })
    );
    m.allocate(&mut c, 2).unwrap();
    assert_ne!(c.blocks(), b.blocks());
    // b's block is cached and in use: no reset.
    assert!(!m.reset_prefix_cache());
    assert_eq!(m.num_cached_blocks(), 1);
    m.free(b);
    m.free(c);
    assert!(m.reset_prefix_cache());
    assert_eq!(m.num_cached_blocks(), 0);
    let mut d = SeqBlocks::new();
    assert_eq!(m.acquire_prefix(&mut d, &t), 0);
    m.check().unwrap();
}

#[test]
fn a_block_computed_twice_keeps_the_first_entry_and_chains_on() {
    let mut m = BlockManager::new(8, 2, true).unwrap();
    let t = toks(7);
    // A and B start together: neither finds anything.
    let (mut a, mut b) = (SeqBlocks::new(), SeqBlocks::new());
    assert_eq!(m.acquire_prefix(&mut a, &t[..4]), 0);
    assert_eq!(m.acquire_prefix(&mut b, &t[..4]), 0);
    m.allocate(&mut a, 4).unwrap();
    m.allocate(&mut b, 4).unwrap();
    m.commit(&mut a, &t[..4], 4);
    m.commit(&mut b, &t[..4], 4);
    assert_eq!((a.num_committed_blocks(), b.num_committed_blocks()), (2, 2));
    assert_eq!(m.num_cached_blocks(), 2);
    // B goes on to a third block, which chains to A's cached prefix.
    m.allocate(&mut b, 6).unwrap();
    m.commit(&mut b, &t, 6);
    assert_eq!(m.num_cached_blocks(), 3);
    let (ab, bb) = (a.blocks().to_vec(), b.blocks().to_vec());
    m.free(a);
    m.free(b);
    let mut c = SeqBlocks::new();
    assert_eq!(m.acquire_prefix(&mut c, &t), 6);
    assert_eq!(c.blocks(), &[ab[0], ab[1], bb[2]]);
    m.check().unwrap();
}

#[test]
fn without_prefix_caching_nothing_is_cached_or_counted() {
    let mut m = BlockManager::new(4, 2, false).unwrap();
    let t = toks(5);
    let mut a = SeqBlocks::new();
    m.allocate(&mut a, 5).unwrap();
    m.commit(&mut a, &t, 5);
    assert_eq!(a.num_committed_blocks(), 0);
    m.free(a);
    let mut b = SeqBlocks::new();
    assert_eq!(m.acquire_prefix(&mut b, &t), 0);
    assert_eq!(m.prefix_stats(), PrefixStats::default());
    assert_eq!(m.num_cached_blocks(), 0);
    assert!(m.reset_prefix_cache());
    m.check().unwrap();
}

#[test]
fn misuse_does_not_panic() {
    let mut big = BlockManager::new(64, 2, true).unwrap();
    let mut m = BlockManager::new(2, 2, true).unwrap();
    let mut foreign = SeqBlocks::new();
    big.allocate(&mut foreign, 128).unwrap();
    big.commit(&mut foreign, &toks(3), 3);
    // A non-empty sequence gets no prefix and counts nothing.
    assert_eq!(m.acquire_prefix(&mut foreign, &toks(3)), 0);
    assert_eq!(m.prefix_stats(), PrefixStats::default());
    // Ids out of range, or of blocks nobody holds here, are skipped.
    m.free(foreign);
    assert_eq!(m.num_free_blocks(), 2);
    // A commit past the allocated blocks enters only those.
    let mut s = SeqBlocks::new();
    m.allocate(&mut s, 2).unwrap();
    m.commit(&mut s, &toks(9), 9);
    assert_eq!(s.num_committed_blocks(), 1);
    // A commit of more than the tokens there are stops at the tokens.
    let mut r = SeqBlocks::new();
    m.allocate(&mut r, 2).unwrap();
    m.commit(&mut r, &[1], 5);
    assert_eq!(r.num_committed_blocks(), 0);
    // A huge slot count is refused, not overflowed.
    assert_eq!(
        m.allocate(&mut s, usize::MAX),
        Err(OutOfBlocks {
            needed: usize::MAX.div_ceil(2) - 1,
            free: 0
        })
    );
    m.free(s);
    m.free(r);
    m.check().unwrap();
}

/// One step of the property test, on sequence slot `slot % SLOTS`.
#[derive(Clone, Debug)]
enum Op {
    /// Start a sequence with these prompt tokens (taking its cached prefix).
    Start(usize, Vec<u32>),
    /// Append tokens, then compute `frac` of what is not computed yet (rounded up).
    Step(usize, Vec<u32>, f64),
    Free(usize),
    Reset,
}

const SLOTS: usize = 6;

fn op() -> impl Strategy<Value = Op> {
    // Tokens from a small alphabet, so prompts share prefixes often.
    let tokens = |max| prop::collection::vec(0u32..3, 0..max);
    prop_oneof![
        4 => (0..SLOTS, tokens(12)).prop_map(|(s, t)| Op::Start(s, t)),
        6 => (0..SLOTS, tokens(4), 0.0..=1.0f64).prop_map(|(s, t, f)| Op::Step(s, t, f)),
        2 => (0..SLOTS).prop_map(Op::Free),
        1 => Just(Op::Reset),
    ]
}

struct Live {
    blocks: SeqBlocks,
    tokens: Vec<u32>,
    computed: usize,
}

#[derive(Default)]
struct Seen {
    hits: Cell<usize>,
    evictions: Cell<usize>,
    out_of_blocks: Cell<usize>,
}

/// Runs `ops` against a manager and a model of the pool's KV: `kv[b]` is the token prefix that
/// block `b`'s written slots were computed for. A hit must hand out blocks whose KV is exactly
/// the queried prefix; reference counts must equal the sequences holding each block.
fn run_ops(
    num_blocks: usize,
    bs: usize,
    colliding: bool,
    ops: &[Op],
    seen: &Seen,
) -> std::result::Result<(), TestCaseError> {
    let mut m = BlockManager::new(num_blocks, bs, true).unwrap();
    if colliding {
        m = m.with_colliding_hashes();
    }
    let mut kv: Vec<Option<Vec<u32>>> = vec![None; num_blocks];
    let mut live: Vec<Option<Live>> = (0..SLOTS).map(|_| None).collect();
    for op in ops {
        match op {
            Op::Start(s, prompt) => {
                if live[*s].is_some() {
                    continue;
                }
                let mut blocks = SeqBlocks::new();
                let hit = m.acquire_prefix(&mut blocks, prompt);
                prop_assert_eq!(hit % bs, 0);
                prop_assert!(hit <= prompt.len().saturating_sub(1) / bs * bs);
                prop_assert_eq!(blocks.blocks().len(), hit / bs);
                for (i, &b) in blocks.blocks().iter().enumerate() {
                    let want = &prompt[..(i + 1) * bs];
                    prop_assert_eq!(kv[b as usize].as_deref(), Some(want), "block {}", b);
                }
                if hit > 0 {
                    seen.hits.set(seen.hits.get() + 1);
                }
                live[*s] = Some(Live {
                    blocks,
                    tokens: prompt.clone(),
                    computed: hit,
                });
            }
            Op::Step(s, more, frac) => {
                let Some(l) = live[*s].as_mut() else {
                    continue;
                };
                l.tokens.extend(more);
                let (free, held) = (m.num_free_blocks(), l.blocks.blocks().to_vec());
                let cached = m.num_cached_blocks();
                match m.allocate(&mut l.blocks, l.tokens.len()) {
                    Err(e) => {
                        let want = l.tokens.len().div_ceil(bs) - held.len();
                        prop_assert_eq!(e, OutOfBlocks { needed: want, free });
                        prop_assert_eq!(m.num_free_blocks(), free);
                        prop_assert_eq!(l.blocks.blocks(), &held[..]);
                        seen.out_of_blocks.set(seen.out_of_blocks.get() + 1);
                        continue;
                    }
                    Ok(()) => {
                        if m.num_cached_blocks() < cached {
                            seen.evictions.set(seen.evictions.get() + 1);
                        }
                        // A new block's old KV is about to be overwritten.
                        for &b in &l.blocks.blocks()[held.len()..] {
                            kv[b as usize] = None;
                        }
                    }
                }
                let left = l.tokens.len() - l.computed;
                let n = ((left as f64 * frac).ceil() as usize).min(left);
                let end = l.computed + n;
                // Write the KV of tokens computed..end: each touched block now holds the prefix
                // up to its last written slot.
                for t in l.computed..end {
                    let b = l.blocks.blocks()[t / bs] as usize;
                    kv[b] = Some(l.tokens[..=t].to_vec());
                }
                l.computed = end;
                m.commit(&mut l.blocks, &l.tokens, end);
                prop_assert_eq!(l.blocks.num_committed_blocks(), end / bs);
            }
            Op::Free(s) => {
                if let Some(l) = live[*s].take() {
                    m.free(l.blocks);
                }
            }
            Op::Reset => {
                let cached_in_use = live
                    .iter()
                    .flatten()
                    .any(|l| l.blocks.num_committed_blocks() > 0);
                let ok = m.reset_prefix_cache();
                // A committed block in use is cached unless it was computed twice; either way
                // a successful reset leaves nothing cached.
                if ok {
                    prop_assert_eq!(m.num_cached_blocks(), 0);
                } else {
                    prop_assert!(cached_in_use);
                }
            }
        }
        m.check().map_err(TestCaseError::fail)?;
        let mut refs = vec![0u32; num_blocks];
        for l in live.iter().flatten() {
            let distinct: HashSet<_> = l.blocks.blocks().iter().collect();
            prop_assert_eq!(distinct.len(), l.blocks.blocks().len());
            for &b in l.blocks.blocks() {
                refs[b as usize] += 1;
            }
        }
        prop_assert_eq!(&refs, &m.refs);
        let used = refs.iter().filter(|&&r| r > 0).count();
        prop_assert_eq!(m.num_used_blocks(), used);
        prop_assert_eq!(m.num_free_blocks() + m.num_used_blocks(), num_blocks);
    }
    for l in live.into_iter().flatten() {
        m.free(l.blocks);
    }
    prop_assert_eq!(m.num_free_blocks(), num_blocks);
    m.check().map_err(TestCaseError::fail)?;
    Ok(())
}

#[test]
fn random_use_keeps_the_invariants_and_hits_are_exact() {
    let seen = Seen::default();
    let mut runner = TestRunner::new(Config {
        cases: 384,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (
        1usize..16,
        1usize..4,
        any::<bool>(),
        prop::collection::vec(op(), 1..60),
    );
    runner
        .run(&strategy, |(n, bs, colliding, ops)| {
            run_ops(n, bs, colliding, &ops, &seen)
        })
        .unwrap();
    // The cases did reach the paths in question.
    assert!(seen.hits.get() > 100, "{} hits", seen.hits.get());
    assert!(
        seen.evictions.get() > 20,
        "{} evictions",
        seen.evictions.get()
    );
    assert!(
        seen.out_of_blocks.get() > 20,
        "{}",
        seen.out_of_blocks.get()
    );
}
