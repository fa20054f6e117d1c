//! The worker protocol: what a launcher and its workers agree on, below
//! every crate that takes part (the launch library and the launcher, the
//! facade, the backends), one file per part:
//!
//! * [`keys`]: the environment variables of the contract (accel's and
//!   torchrun's names);
//! * [`WorkerEnv`] (`env.rs`): the variables one worker gets, written by
//!   every launcher ([`WorkerEnv::to_vars`]) and read back by the runtime
//!   ([`WorkerEnv::from_vars`]); a property test round-trips every field;
//!   [`default_dump_dir`]: where a run's flight-recorder dumps go when
//!   `ACCEL_DUMP_DIR` says nothing;
//! * `parse.rs`: the parsers of its values ([`parse_number`],
//!   [`parse_flag`], [`parse_duration`], ...) and the bounds of the one
//!   timeout ([`MIN_TIMEOUT`], [`DEFAULT_TIMEOUT`], [`MAX_TIMEOUT`]);
//! * `settings.rs`: the settings it carries as plain protocol values:
//!   [`ProcessModel`], [`MixedPrecision`], the ZeRO [`Stage`];
//! * [`ErrorRecord`] (`record.rs`): the root cause a failing worker writes
//!   to `ACCEL_ERROR_FILE` (or `TORCHELASTIC_ERROR_FILE`) and the launcher
//!   reads, in accel's format or torch elastic's `@record` format;
//!   [`error_file_from_env`] finds where it goes;
//! * the rank tag ([`tag_line`], [`untag_line`]; `tag.rs`): how a process
//!   whose ranks are threads marks each output line with its rank for the
//!   launcher;
//! * [`stall`]: the stall inspector's records in the run's store and the
//!   [`StallVerdict`](stall::StallVerdict) the launcher reads.
//!
//! Under an MPI launcher the rank fields stay `None`: MPI numbers the ranks
//! (`OMPI_COMM_WORLD_*`, `PMI_*`), and [`keys::NUMBERED_BY_LAUNCHER`] lists
//! the variables a launcher must remove from mpirun's environment.

mod env;
pub mod keys;
mod parse;
mod record;
mod settings;
pub mod stall;
mod tag;

pub use env::{default_dump_dir, WorkerEnv};
pub use parse::{
    format_duration, parse_accumulation_steps, parse_duration, parse_flag, parse_number, tcp_url,
    DEFAULT_TIMEOUT, MAX_TIMEOUT, MIN_TIMEOUT,
};
pub use record::{error_file_from_env, write_error_file, write_first_error, ErrorRecord};
pub use settings::{MixedPrecision, ProcessModel, Stage};
pub use tag::{tag_line, untag_line};
