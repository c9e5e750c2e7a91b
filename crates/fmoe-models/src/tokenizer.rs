//! `tokenizer.json` through the `tokenizers` crate (built with pure-Rust `fancy-regex`: no
//! Oniguruma, no C++).
//!
//! Encoding is bounded ([`EncodeLimits`]): the prompt's bytes before anything runs, the text the
//! tokenizer's normalizer makes of it (measured piece by piece before the real encode, so a
//! normalizer that expands one character into thousands is refused before it builds the whole
//! expansion), and the number of tokens out.

use std::path::{Path, PathBuf};

use tokenizers::{NormalizedString, Normalizer};

use crate::loader::read_regular_file;
use crate::{Error, Result};

/// The file name a model directory keeps its tokenizer in.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The largest `tokenizer.json` read (real ones are a few MiB, the largest vocabularies tens).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// Bounds of one [`Tokenizer::encode_with_limits`]; every one is an error naming it when
/// exceeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncodeLimits {
    /// Bytes of input text.
    pub max_input_bytes: usize,
    /// Bytes of the normalizer's output (NFKC, replacements, prefixes; the input itself when the
    /// tokenizer has no normalizer).
    pub max_normalized_bytes: usize,
    /// Token ids out (special tokens included).
    pub max_tokens: usize,
}

impl Default for EncodeLimits {
    /// 1 MiB of text, 4 MiB normalized, 1 Mi tokens: far above any model's context, far below
    /// what would exhaust memory (the tokenizer keeps tens of bytes per token).
    fn default() -> Self {
        EncodeLimits {
            max_input_bytes: 1 << 20,
            max_normalized_bytes: 4 << 20,
            max_tokens: 1 << 20,
        }
    }
}

/// Input bytes normalized at a time to measure the normalizer's output: the most memory one
/// step can take is this times the normalizer's largest expansion of one byte.
const NORMALIZE_PIECE_BYTES: usize = 64;

/// A loaded `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl Tokenizer {
    /// Loads `path`, which must be a regular file of at most [`MAX_TOKENIZER_BYTES`].
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let bytes =
            read_regular_file(path, TOKENIZER_FILE, MAX_TOKENIZER_BYTES).map_err(|e| match e {
                Error::Io { err, .. } if err.kind() == std::io::ErrorKind::NotFound => {
                    Error::Tokenizer {
                        path: path.to_path_buf(),
                        msg: "file not found".into(),
                    }
                }
                other => other,
            })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| Error::Tokenizer {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        Ok(Tokenizer {
            inner,
            path: path.to_path_buf(),
        })
    }

    /// `dir/tokenizer.json` if it exists (anything there that is not a regular file, such as a
    /// directory or a FIFO, is an error naming it, not "no tokenizer").
    pub fn from_dir(dir: &Path) -> Result<Option<Tokenizer>> {
        let path = dir.join(TOKENIZER_FILE);
        match std::fs::metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            _ => Tokenizer::from_file(&path).map(Some),
        }
    }

    /// Token ids of `text` within [`EncodeLimits::default`]; `add_special_tokens` adds what the
    /// tokenizer's post-processor adds (Mixtral's BOS), as transformers does by default.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.encode_with_limits(text, add_special_tokens, &EncodeLimits::default())
    }

    /// [`Tokenizer::encode`] within `limits`: the input's bytes are checked first, the
    /// normalizer's output is measured piece by piece before the real encode (see the module
    /// docs), and the tokens out are counted.
    pub fn encode_with_limits(
        &self,
        text: &str,
        add_special_tokens: bool,
        limits: &EncodeLimits,
    ) -> Result<Vec<u32>> {
        if text.len() > limits.max_input_bytes {
            return Err(self.limit(format!(
                "the text is {} bytes, more than the {} a prompt may have",
                text.len(),
                limits.max_input_bytes
            )));
        }
        let normalized = self.normalized_len(text, limits.max_normalized_bytes)?;
        if normalized > limits.max_normalized_bytes {
            return Err(self.limit(format!(
                "the tokenizer's normalizer makes more than {} bytes of this {}-byte text",
                limits.max_normalized_bytes,
                text.len()
            )));
        }
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| self.err(e))?;
        let ids = enc.get_ids();
        if ids.len() > limits.max_tokens {
            return Err(self.limit(format!(
                "the text encodes to {} tokens, more than the {} allowed",
                ids.len(),
                limits.max_tokens
            )));
        }
        Ok(ids.to_vec())
    }

    /// The bytes the normalizer makes of `text`, summed over pieces of at most
    /// [`NORMALIZE_PIECE_BYTES`] (cut at char boundaries), stopping as soon as the sum passes
    /// `stop_above`. Normalizers work character by character (or on short patterns), so the sum
    /// measures the whole text's expansion closely; it only has to bound it.
    fn normalized_len(&self, text: &str, stop_above: usize) -> Result<usize> {
        let Some(normalizer) = self.inner.get_normalizer() else {
            return Ok(text.len());
        };
        let mut total = 0usize;
        let mut rest = text;
        while !rest.is_empty() {
            let mut cut = rest.len().min(NORMALIZE_PIECE_BYTES);
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            let (piece, tail) = rest.split_at(cut);
            let mut n = NormalizedString::from(piece);
            normalizer.normalize(&mut n).map_err(|e| self.err(e))?;
            total = total.saturating_add(n.get().len());
            if total > stop_above {
                break;
            }
            rest = tail;
        }
        Ok(total)
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| self.err(e))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn err(&self, e: tokenizers::Error) -> Error {
        Error::Tokenizer {
            path: self.path.clone(),
            msg: e.to_string(),
        }
    }

    fn limit(&self, msg: String) -> Error {
        Error::Tokenizer {
            path: self.path.clone(),
            msg,
        }
    }
}
