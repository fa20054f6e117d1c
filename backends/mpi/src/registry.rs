//! A process-wide list of live objects and the one thread that serves
//! them: the progress records' writer and the watchdog each keep one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::Thread;

/// Weak references to the live `T`s of the process, and whether their
/// thread runs.
pub(crate) struct Registry<T> {
    list: Mutex<Vec<Weak<T>>>,
    started: AtomicBool,
}

impl<T> Registry<T> {
    /// An empty registry, its thread not started.
    pub(crate) const fn new() -> Registry<T> {
        Registry {
            list: Mutex::new(Vec::new()),
            started: AtomicBool::new(false),
        }
    }

    /// The `T`s still alive (the dropped ones are forgotten).
    pub(crate) fn live(&self) -> Vec<Arc<T>> {
        let mut list = self.list.lock().unwrap_or_else(|p| p.into_inner());
        list.retain(|w| w.strong_count() > 0);
        list.iter().filter_map(Weak::upgrade).collect()
    }

    /// Register `item`; the first call (and the next one after a start
    /// that failed) starts the thread `name` running `body`.
    ///
    /// # Errors
    /// The thread could not be started (`item` stays registered).
    pub(crate) fn add<F>(&self, item: &Arc<T>, name: &str, body: F) -> std::io::Result<Started>
    where
        F: FnOnce() + Send + 'static,
    {
        self.list
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::downgrade(item));
        if self.started.swap(true, Ordering::SeqCst) {
            return Ok(Started::Before);
        }
        match std::thread::Builder::new().name(name.into()).spawn(body) {
            Ok(h) => Ok(Started::Now(h.thread().clone())),
            Err(e) => {
                self.started.store(false, Ordering::SeqCst);
                Err(e)
            }
        }
    }
}

/// Whether [`Registry::add`] started the thread.
pub(crate) enum Started {
    /// It was running already.
    Before,
    /// This call started it.
    Now(Thread),
}
