//! fmoe-engine: turns a [`fmoe_models::CausalLm`] into generated text.
//!
//! - [`ContiguousKvCache`] implements the model's [`fmoe_models::KvCache`] on the host: per
//!   sequence, per layer, contiguous growth (the CPU path). [`SlabKvCache`] is the device cache:
//!   per layer and stream one preallocated slab in the model's dtype, a contiguous slot range per
//!   sequence. [`ModelKvCache`] is whichever the model's `kv_storage` asks for.
//! - [`Sampler`] picks tokens: greedy, or temperature, top-k and top-p from a seeded RNG
//!   ([`SamplingParams`]); [`logprobs`] gives what an API reports of a token's probability.
//! - [`BlockManager`] hands out the blocks of a paged KV pool to sequences ([`SeqBlocks`]), with
//!   prefix caching: full blocks already computed for the same token prefix are shared.
//! - [`IncrementalDecoder`] turns generated ids into text deltas, one token at a time;
//!   [`StopMatcher`] finds stop strings in those deltas.
//! - [`generate`] runs prefill (all prompts in one pass) then decode (one token per live
//!   sequence per pass) until max tokens, an EOS id or a stop string ([`GenerateParams`]), and
//!   returns per-prompt [`Output`]s with [`Stats`].
//!
//! ```no_run
//! use fmoe_engine::{GenerateParams, generate};
//! use fmoe_models::{LoadOptions, load};
//! let m = load(std::path::Path::new("tests/fixtures/tiny-mixtral"), &LoadOptions::default())?;
//! let g = generate(m.model.as_ref(), m.tokenizer.as_ref(), &[vec![1, 2, 3]], &GenerateParams::default())?;
//! println!("{:?} ({:.1} tokens/s)", g.outputs[0].token_ids, g.stats.tokens_per_s());
//! # Ok::<(), fmoe_engine::Error>(())
//! ```

mod block_manager;
mod detokenize;
mod error;
mod generate;
mod kv_cache;
mod sampler;
mod slab_cache;

pub use block_manager::{BlockId, BlockManager, OutOfBlocks, PrefixStats, SeqBlocks};
pub use detokenize::{IncrementalDecoder, StopMatcher};
pub use error::{Error, Result};
pub use generate::{FinishReason, GenerateParams, Generation, Output, Stats, generate};
pub use kv_cache::{ContiguousKvCache, ModelKvCache};
pub use sampler::{Sampler, SamplingParams, TokenLogprobs, argmax, logprobs};
pub use slab_cache::SlabKvCache;
