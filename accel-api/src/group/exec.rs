//! Issue order: every call a group admits gets a ticket, and calls run in
//! ticket order, whether the caller runs them (blocking calls) or the
//! group's worker thread does (calls started without waiting).

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Condvar, Mutex};
use std::thread::JoinHandle;

use crate::sync::lock;

/// Whose turn it is: the ticket of the next call to run.
#[derive(Debug, Default)]
pub(crate) struct Turn {
    next: Mutex<u64>,
    changed: Condvar,
}

impl Turn {
    /// Wait for `ticket`'s turn; the turn passes to the next ticket when
    /// the returned guard drops (also on a panic). Earlier tickets always
    /// end: each is a call that some thread runs, bounded by the engine's
    /// timeout.
    pub(crate) fn take(&self, ticket: u64) -> Pass<'_> {
        let mut next = lock(&self.next);
        while *next != ticket {
            next = self.changed.wait(next).unwrap_or_else(|p| p.into_inner());
        }
        Pass(self)
    }
}

/// A call's turn; dropping it gives the turn to the next ticket.
#[derive(Debug)]
pub(crate) struct Pass<'a>(&'a Turn);

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        *lock(&self.0.next) += 1;
        self.0.changed.notify_all();
    }
}

pub(crate) type Job = Box<dyn FnOnce() + Send>;

thread_local! {
    static ON_WORKER: Cell<bool> = const { Cell::new(false) };
}

/// `true` on a group's worker thread, which runs only calls started
/// without waiting: an engine may wait there in a way that leaves the
/// cores to the caller's compute (mpi polls its non-blocking calls with
/// pauses instead of spinning in a blocking one).
pub fn on_group_worker() -> bool {
    ON_WORKER.with(Cell::get)
}

/// The thread that runs a group's started calls, in the order they were
/// queued (which is ticket order: tickets and the queue share one lock).
#[derive(Debug)]
pub(crate) struct Worker {
    queue: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    pub(crate) fn spawn(name: String) -> std::io::Result<Worker> {
        let (tx, rx) = channel::<Job>();
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            ON_WORKER.with(|w| w.set(true));
            for job in rx {
                // A job completes its handle itself; a panic inside one
                // completes it with an error (the completer's drop) and
                // must not take the queue down.
                let _ = catch_unwind(AssertUnwindSafe(job));
            }
        })?;
        Ok(Worker {
            queue: Some(tx),
            thread: Some(thread),
        })
    }

    /// Queue `job`; the job comes back when the thread is gone.
    pub(crate) fn push(&self, job: Job) -> std::result::Result<(), Job> {
        match &self.queue {
            Some(q) => q.send(job).map_err(|e| e.0),
            None => Err(job),
        }
    }
}

impl Drop for Worker {
    /// Runs what is queued, then ends the thread.
    fn drop(&mut self) {
        drop(self.queue.take());
        if let Some(t) = self.thread.take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}
