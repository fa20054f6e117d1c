//! # accel-test-support: what the tests of several crates share
//!
//! A dev-dependency (a normal one of `examples/minilm-data`, whose library
//! helps the MiniLM examples' tests). Each module is one concern:
//!
//! | module | holds | feature |
//! |---|---|---|
//! | [`child`] | a child process waited for under a deadline, run to the end | |
//! | [`skips`] | whether a test can run here (root, mpirun); a skip fails under CI | |
//! | [`python`] | the torch venv's Python, found and run | |
//! | [`log_lines`] | a tracing subscriber that hands each event on as one line | |
//! | [`special_files`] | FIFOs and a call timed on its own thread | |
//! | [`demo_ranks`] | an example's binary run as rank processes; the digits demos' output | |
//! | `ranks` | two rank threads over cpu-gloo | `ranks` |
//! | `env_cases` | the worker-environment cases and their generators | `env-cases` |
//! | `fuzz` | the bounded fuzz driver and byte mutations | `fuzz` |
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod child;
pub mod demo_ranks;
#[cfg(feature = "env-cases")]
pub mod env_cases;
pub mod etcd;
#[cfg(feature = "fuzz")]
pub mod fuzz;
pub mod log_lines;
pub mod python;
#[cfg(feature = "ranks")]
pub mod ranks;
pub mod skips;
pub mod special_files;
pub mod tls;

/// A loopback port that was free a moment ago (for a server a test starts,
/// or runs over several machines, which need a fixed port).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}
