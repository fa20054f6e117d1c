//! The worker environment contract: the variables a launcher gives each
//! worker, with one owner, [`accel_api::worker`] (below the launch library,
//! the facade and the backends). Re-exported here, where programs and
//! tests have always named it (`accel::worker_env::WorkerEnv`).
//!
//! [`WorkerEnv`] is what `accel launch` (local workers and mpirun), the
//! conformance harness and [`Accelerator::from_communicator`] write with
//! [`WorkerEnv::to_vars`], and what [`ProcessState`](crate::ProcessState)
//! reads with [`WorkerEnv::from_vars`].
//!
//! [`Accelerator::from_communicator`]: crate::Accelerator::from_communicator

pub use accel_api::worker::{
    format_duration, keys, parse_accumulation_steps, parse_duration, parse_flag, parse_number,
    tcp_url, ProcessModel, WorkerEnv, MAX_TIMEOUT,
};
