//! Streaming text: [`IncrementalDecoder`] turns generated ids into text deltas without decoding
//! the whole output each step, and [`StopMatcher`] finds stop strings in those deltas, holding
//! back only a tail that could still start one.

use fmoe_models::Tokenizer;

use crate::{Error, Result};

/// Prompt ids an [`IncrementalDecoder`] keeps as context before the generated ones (vLLM's
/// initial detokenization offset).
const PROMPT_CONTEXT: usize = 5;

/// Text of generated ids, one token at a time (the scheme of vLLM's `detokenize_incrementally`).
///
/// It decodes a short window of ids: `ids[prefix_offset..read_offset]` is text already emitted
/// (kept as context, so a decoder that treats a sequence's first token apart, such as
/// SentencePiece's leading-space strip, sees the same first token in both decodes), and
/// `ids[read_offset..]` is new. The new text is `decode(ids[prefix_offset..])` past
/// `decode(ids[prefix_offset..read_offset])`; it is held back while it ends in U+FFFD (a
/// character whose bytes have not all come yet), then emitted, and the window moves on. Each push
/// costs two decodes of a few tokens, whatever the output's length (longer only while invalid
/// UTF-8 keeps arriving).
///
/// What the text is:
/// - `IncrementalDecoder::new(&[])`: the deltas, with [`IncrementalDecoder::flush`] at the end,
///   add up to exactly `tokenizer.decode(generated ids)`, the text `generate` returns. The
///   engine uses this.
/// - `IncrementalDecoder::new(prompt)`: the last few prompt ids are context, so the text is how
///   the generated ids read after the prompt (as vLLM reports it): `decode(tail ++ generated)`
///   past `decode(tail)`. For a decoder that strips the first token's leading space this keeps
///   that space (`" Hello"` where `decode(generated)` gives `"Hello"`), and a character whose
///   first bytes end the prompt comes out whole with the token that completes it.
pub struct IncrementalDecoder {
    /// Context ids, then the generated ids.
    ids: Vec<u32>,
    /// How many of `ids` are context.
    context: usize,
    prefix_offset: usize,
    read_offset: usize,
    text: String,
}

impl IncrementalDecoder {
    /// A decoder continuing `prompt_ids` (see the type's docs; `&[]` for exactly the decode of
    /// the generated ids).
    pub fn new(prompt_ids: &[u32]) -> IncrementalDecoder {
        let tail = &prompt_ids[prompt_ids.len().saturating_sub(PROMPT_CONTEXT)..];
        IncrementalDecoder {
            ids: tail.to_vec(),
            context: tail.len(),
            prefix_offset: 0,
            read_offset: tail.len(),
            text: String::new(),
        }
    }

    /// Adds generated id `id`; returns the text it completes (often empty while a multi-byte
    /// character is split across tokens).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        self.advance(tok, false)
    }

    /// The text still held back (an incomplete character at the end), emitted as it decodes now
    /// (with its U+FFFD). For the end of generation.
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        self.advance(tok, true)
    }

    /// Everything emitted so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Generated ids pushed so far.
    pub fn num_generated(&self) -> usize {
        self.ids.len() - self.context
    }

    fn advance(&mut self, tok: &Tokenizer, force: bool) -> Result<String> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let prefix_text = tok.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let new_text = tok.decode(&self.ids[self.prefix_offset..])?;
        if !force && new_text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = &new_text[common_prefix_len(&prefix_text, &new_text)..];
        if delta.is_empty() && !force {
            // Nothing new yet (a skipped special token, say): keep the window where it is, so
            // its first id stays the one whose text came before.
            return Ok(String::new());
        }
        self.text.push_str(delta);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(delta.to_string())
    }
}

/// Bytes `a` and `b` share at the start, at a character boundary of both.
fn common_prefix_len(a: &str, b: &str) -> usize {
    let mut n = 0;
    for ((i, ca), cb) in a.char_indices().zip(b.chars()) {
        if ca != cb {
            return i;
        }
        n = i + ca.len_utf8();
    }
    n
}

/// Stop strings, matched incrementally over text deltas.
///
/// The text stops at the first character where some stop string is complete; when several end
/// there, the longest (the one starting earliest) is the one reported. Text that can no longer be
/// part of a stop string is released at once; the tail that could still start one (at most the
/// longest stop's length less one character) is held back. Matching is an Aho–Corasick automaton
/// over the stops' bytes, so a push costs O(delta + longest stop), whatever the text's length.
pub struct StopMatcher {
    stops: Vec<String>,
    nodes: Vec<Node>,
    state: usize,
    held: String,
    stopped: Option<usize>,
}

struct Node {
    /// Trie edges by byte, sorted.
    edges: Vec<(u8, usize)>,
    /// The node of the longest proper suffix of this node's string that is a trie node.
    fail: usize,
    /// Length of this node's string in bytes.
    depth: usize,
    /// The longest stop string that ends this node's string.
    out: Option<usize>,
}

impl Node {
    fn edge(&self, b: u8) -> Option<usize> {
        self.edges
            .binary_search_by_key(&b, |e| e.0)
            .ok()
            .map(|i| self.edges[i].1)
    }
}

impl StopMatcher {
    /// A matcher for `stops` (none is fine: everything is released at once). An empty stop
    /// string is an error.
    pub fn new(stops: Vec<String>) -> Result<StopMatcher> {
        if let Some(i) = stops.iter().position(String::is_empty) {
            return Err(Error::Request(format!("stop string {i} is empty")));
        }
        let mut nodes = vec![Node {
            edges: Vec::new(),
            fail: 0,
            depth: 0,
            out: None,
        }];
        for (k, s) in stops.iter().enumerate() {
            let mut at = 0;
            for &b in s.as_bytes() {
                at = match nodes[at].edge(b) {
                    Some(next) => next,
                    None => {
                        let next = nodes.len();
                        let depth = nodes[at].depth + 1;
                        nodes.push(Node {
                            edges: Vec::new(),
                            fail: 0,
                            depth,
                            out: None,
                        });
                        let edges = &mut nodes[at].edges;
                        let pos = edges.partition_point(|e| e.0 < b);
                        edges.insert(pos, (b, next));
                        next
                    }
                };
            }
            // A repeated stop string keeps its first index.
            nodes[at].out.get_or_insert(k);
        }
        // Failure links breadth first: a node's links come from shallower nodes.
        let mut queue = std::collections::VecDeque::from([0usize]);
        while let Some(at) = queue.pop_front() {
            for i in 0..nodes[at].edges.len() {
                let (b, child) = nodes[at].edges[i];
                let fail = if at == 0 {
                    0
                } else {
                    let mut f = nodes[at].fail;
                    loop {
                        if let Some(t) = nodes[f].edge(b) {
                            break t;
                        }
                        if f == 0 {
                            break 0;
                        }
                        f = nodes[f].fail;
                    }
                };
                nodes[child].fail = fail;
                if nodes[child].out.is_none() {
                    nodes[child].out = nodes[fail].out;
                }
                queue.push_back(child);
            }
        }
        Ok(StopMatcher {
            stops,
            nodes,
            state: 0,
            held: String::new(),
            stopped: None,
        })
    }

    /// Feeds the next text delta. Returns the text that may go to the client now and, when a
    /// stop string completed, that stop (the text returned then ends right before it, and
    /// everything after is dropped). After a stop, pushes release nothing.
    pub fn push(&mut self, delta: &str) -> (String, Option<String>) {
        if self.stopped.is_some() {
            return (String::new(), None);
        }
        let mut buf = std::mem::take(&mut self.held);
        let start = buf.len();
        buf.push_str(delta);
        for (i, &b) in delta.as_bytes().iter().enumerate() {
            self.state = self.step(self.state, b);
            if let Some(k) = self.nodes[self.state].out {
                // The held tail covers every byte of a possible match, so the stop starts
                // within `buf`.
                let cut = (start + i + 1).saturating_sub(self.stops[k].len());
                buf.truncate(floor_char_boundary(&buf, cut));
                self.stopped = Some(k);
                self.state = 0;
                return (buf, Some(self.stops[k].clone()));
            }
        }
        // The tail that is a prefix of a stop (it starts where a stop's first byte, a character's
        // first byte, matched, so at a character boundary).
        let keep = self.nodes[self.state].depth.min(buf.len());
        let at = floor_char_boundary(&buf, buf.len() - keep);
        self.held = buf.split_off(at);
        (buf, None)
    }

    /// The held-back tail, at the end of generation (empty after a stop).
    pub fn flush(&mut self) -> String {
        self.state = 0;
        std::mem::take(&mut self.held)
    }

    /// The stop string that ended the text, if one did.
    pub fn stopped(&self) -> Option<&str> {
        self.stopped.map(|k| self.stops[k].as_str())
    }

    /// The automaton's move from `at` on byte `b`.
    fn step(&self, mut at: usize, b: u8) -> usize {
        loop {
            if let Some(t) = self.nodes[at].edge(b) {
                return t;
            }
            if at == 0 {
                return 0;
            }
            at = self.nodes[at].fail;
        }
    }
}

/// The largest character boundary of `s` at or below `i`.
fn floor_char_boundary(s: &str, i: usize) -> usize {
    let mut i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests;
