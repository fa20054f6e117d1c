//! [`Event`]: what a process group and the signal handler tell the
//! supervisor. A leaf below both (`group` sends, `supervise` receives).

use crate::report::{Exit, Failure};

/// What the supervisor reacts to.
#[derive(Debug)]
pub enum Event {
    /// A started process ended.
    Exited {
        /// Attempt it belongs to.
        attempt: u32,
        /// Its index among the group's started processes.
        index: usize,
        /// How it ended.
        exit: Exit,
    },
    /// The launcher received a signal (SIGINT, SIGTERM, SIGHUP).
    Signal(i32),
    /// A worker on another machine failed first.
    Remote {
        /// Attempt it belongs to.
        attempt: u32,
        /// The root cause it published.
        failure: Box<Failure>,
    },
    /// The store (machine 0) went away.
    StoreLost {
        /// Attempt it belongs to.
        attempt: u32,
        /// What the store client said.
        message: String,
    },
}
