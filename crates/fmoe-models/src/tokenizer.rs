//! `tokenizer.json` through the `tokenizers` crate (built with pure-Rust `fancy-regex`: no
//! Oniguruma, no C++).

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The file name a model directory keeps its tokenizer in.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// A loaded `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        if !path.is_file() {
            return Err(Error::Tokenizer {
                path: path.to_path_buf(),
                msg: "file not found".into(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| Error::Tokenizer {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        Ok(Tokenizer {
            inner,
            path: path.to_path_buf(),
        })
    }

    /// `dir/tokenizer.json` if it exists.
    pub fn from_dir(dir: &Path) -> Result<Option<Tokenizer>> {
        let path = dir.join(TOKENIZER_FILE);
        if path.is_file() {
            Tokenizer::from_file(&path).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Token ids of `text`; `add_special_tokens` adds what the tokenizer's post-processor adds
    /// (Mixtral's BOS), as transformers does by default.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| self.err(e))?;
        Ok(enc.get_ids().to_vec())
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
}
