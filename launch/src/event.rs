//! [`Event`]: what a process group, a coordinator and the signal handler
//! tell the supervisor, and the last signal the launcher received
//! ([`LAST_SIGNAL`]). A leaf below them all (`group` and `coordinate` send,
//! `supervise` receives).

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::Sender;

use accel_api::{Error, Result};

use crate::report::{Exit, Failure};

/// The last signal the launcher received (0: none), for loops that do not
/// read the event channel (the machines' join).
pub static LAST_SIGNAL: AtomicI32 = AtomicI32::new(0);

/// Forward SIGINT, SIGTERM and SIGHUP to `tx` as [`Event::Signal`] (and
/// record them in [`LAST_SIGNAL`]), and SIGUSR1 as [`Event::Dump`] (the
/// run goes on).
///
/// # Errors
/// The handlers or their thread cannot be installed.
pub fn install_signals(tx: Sender<Event>) -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP, SIGUSR1])
        .map_err(|e| Error::io("cannot install the signal handlers", e))?;
    std::thread::Builder::new()
        .name("accel-signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                let event = if sig == SIGUSR1 {
                    Event::Dump
                } else {
                    LAST_SIGNAL.store(sig, Ordering::SeqCst);
                    Event::Signal(sig)
                };
                if tx.send(event).is_err() {
                    break;
                }
            }
        })
        .map_err(|e| Error::io("cannot start the signal thread", e))?;
    Ok(())
}

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
    /// The launcher received SIGUSR1 (`accel dump`): every rank is asked
    /// to dump its flight recorder, and the run goes on.
    Dump,
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
