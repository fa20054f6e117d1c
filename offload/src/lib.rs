//! Big-model inference for accel: run models larger than one device by
//! spreading them over accelerators, host RAM and disk.
//!
//! | piece | module |
//! |---|---|
//! | ordered module tree + tied groups, JSON format, built from safetensors headers | [`layout`] |
//! | device-map planner (Accelerate's `infer_auto_device_map` policy, O(n log n), validated) | [`plan`] |
//! | offload stores: host RAM, mmap'd safetensors, Accelerate's offload folder | [`store`] |
//! | safetensors reading/writing, sharded checkpoints | [`safetensors`] |
//! | loading a checkpoint into a plan, with progress | [`load`] |
//! | layer-by-layer execution with prefetch | [`exec`] |
//! | `load_checkpoint_and_dispatch` for any framework: match, tie, plan, place, load, check, run blocks ([`dispatch::Framework`] is a framework's part) | [`dispatch`] |
//! | a model's layout from a checkpoint or a layout file, for `accel plan` | [`source`] |
//! | model size, largest layer, Adam training memory per dtype (`accel estimate-memory`) | [`estimate`] |
//! | synthetic layouts and checkpoints (tests, benchmarks) | [`synth`] |
//!
//! The command line (`accel plan`, `accel estimate-memory`) lives in the
//! launcher crate; this one has no CLI dependencies.
//!
//! The crate's only `unsafe` is the read-only `mmap` call in one private
//! module, documented there.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod arena;
mod convert;
pub mod dispatch;
pub mod estimate;
pub mod exec;
pub mod layout;
pub mod load;
mod mmap;
pub mod plan;
pub mod safetensors;
pub mod source;
pub mod store;
pub mod synth;
pub mod util;
