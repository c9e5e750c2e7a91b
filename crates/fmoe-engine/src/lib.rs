//! fmoe-engine: serves a [`fmoe_models::CausalLm`]: a paged KV pool shared by every request,
//! continuous batching with chunked prefill, prefix caching and preemption, and the request API a
//! server drives.
//!
//! - [`Engine`]: [`Engine::add_request`] / [`Engine::step`] / [`Engine::abort`] over a
//!   [`ModelRunner`] (the model and its [`fmoe_models::KvPool`]) and the scheduler
//!   ([`scheduler`]: token budget, FCFS admission, preemption by recompute) with its
//!   [`BlockManager`] (blocks, prefix cache); sizes from [`EngineArgs::resolve`].
//! - [`EngineHandle`]: the engine on its own thread, requests and streamed outputs over channels.
//! - [`Sampler`]: greedy, or temperature, top-k and top-p from a per-request seeded RNG
//!   ([`SamplingParams`]); [`logprobs`].
//! - [`IncrementalDecoder`] and [`StopMatcher`]: text deltas and stop strings, a token at a time.
//! - [`generate`]: every prompt a request, stepped to the end ([`GenerateParams`]).
//! - [`DirectSession`]: a runner driven chunk by chunk, without a scheduler (tests, benchmarks).
//!
//! ```no_run
//! use std::sync::Arc;
//! use fmoe_engine::{Engine, EngineArgs, GenerateParams, generate};
//! use fmoe_models::{LoadOptions, load};
//! let m = load(std::path::Path::new("tests/fixtures/tiny-mixtral"), &LoadOptions::default())?;
//! let model: Arc<dyn fmoe_models::CausalLm> = Arc::from(m.model);
//! let config = EngineArgs::default().resolve(&model)?;
//! let mut engine = Engine::new(model, m.tokenizer, config)?;
//! let g = generate(&mut engine, &[vec![1, 2, 3]], &GenerateParams::default())?;
//! println!("{:?} ({:.1} tokens/s)", g.outputs[0].token_ids, g.stats.tokens_per_s());
//! # Ok::<(), fmoe_engine::Error>(())
//! ```

pub mod block_manager;
mod config;
pub mod detokenize;
mod engine;
mod error;
mod generate;
mod handle;
mod request;
mod runner;
pub mod sampler;
pub mod scheduler;

pub use block_manager::{BlockId, BlockManager, OutOfBlocks, PrefixStats, SeqBlocks};
pub use config::{DEFAULT_KV_CACHE_MEMORY, EngineArgs};
pub use detokenize::{IncrementalDecoder, StopMatcher};
pub use engine::{Engine, EngineConfig, EngineStats};
pub use error::{Error, Result};
pub use generate::{GenerateParams, Generation, Output, Stats, generate};
pub use handle::{EngineHandle, RequestStream};
pub use request::{FinishReason, Request, RequestId, RequestOutput, RequestParams, Timings};
pub use runner::{DirectSession, LogitsFor, ModelRunner, SeqChunk, SeqId, StepOutput};
pub use sampler::{Sampler, SamplingParams, TokenLogprobs, argmax, logprobs};
pub use scheduler::SchedulerConfig;
