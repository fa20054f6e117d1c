use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use accel_api::{CasOutcome, Error, ErrorKind, Result, Store};

/// A store in the memory of one process: threads standing in for ranks,
/// tests, and the state behind the TCP server.
#[derive(Debug, Default)]
pub struct MemoryStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait until every key in `keys` is set, up to `timeout`; `Err(missing
    /// keys)` after. A timeout too large to represent means "no deadline".
    fn wait_until(
        &self,
        keys: &[&str],
        timeout: Duration,
    ) -> std::result::Result<MutexGuard<'_, HashMap<String, Vec<u8>>>, Vec<String>> {
        match self.wait_inner(keys, timeout, None) {
            Waited::Ready(map) => Ok(map),
            Waited::Missing(m) => Err(m),
            // Without a cancel flag nothing can cancel.
            Waited::Cancelled => Err(keys.iter().map(|k| k.to_string()).collect()),
        }
    }

    fn wait_inner(
        &self,
        keys: &[&str],
        timeout: Duration,
        cancel: Option<&AtomicBool>,
    ) -> Waited<MutexGuard<'_, HashMap<String, Vec<u8>>>> {
        let deadline = Instant::now().checked_add(timeout);
        let mut map = self.lock();
        loop {
            // Checked under the lock: `wake_waiters` takes the lock before
            // notifying, so a flag set before it is never missed.
            if cancel.is_some_and(|c| c.load(Ordering::SeqCst)) {
                return Waited::Cancelled;
            }
            if keys.iter().all(|k| map.contains_key(*k)) {
                return Waited::Ready(map);
            }
            let now = Instant::now();
            let left = match deadline {
                Some(d) if now >= d => {
                    return Waited::Missing(
                        keys.iter()
                            .filter(|k| !map.contains_key(**k))
                            .map(|k| k.to_string())
                            .collect(),
                    )
                }
                Some(d) => d - now,
                None => Duration::from_secs(3600),
            };
            map = self
                .changed
                .wait_timeout(map, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// [`Store::get`] that also returns early once `cancel` is set and
    /// [`wake_waiters`](Self::wake_waiters) was called (TCP server shutdown).
    pub(crate) fn get_or_cancel(
        &self,
        key: &str,
        timeout: Duration,
        cancel: &AtomicBool,
    ) -> Waited<Vec<u8>> {
        match self.wait_inner(&[key], timeout, Some(cancel)) {
            Waited::Ready(map) => Waited::Ready(map[key].clone()),
            Waited::Missing(m) => Waited::Missing(m),
            Waited::Cancelled => Waited::Cancelled,
        }
    }

    /// [`Store::wait`] that also returns early once `cancel` is set and
    /// [`wake_waiters`](Self::wake_waiters) was called.
    pub(crate) fn wait_or_cancel(
        &self,
        keys: &[&str],
        timeout: Duration,
        cancel: &AtomicBool,
    ) -> Waited<()> {
        match self.wait_inner(keys, timeout, Some(cancel)) {
            Waited::Ready(_) => Waited::Ready(()),
            Waited::Missing(m) => Waited::Missing(m),
            Waited::Cancelled => Waited::Cancelled,
        }
    }

    /// Wake every blocked waiter so that it re-checks its cancel flag.
    pub(crate) fn wake_waiters(&self) {
        let _map = self.lock();
        self.changed.notify_all();
    }
}

/// How a cancellable wait ended.
#[derive(Debug)]
pub(crate) enum Waited<T> {
    /// Every key was set.
    Ready(T),
    /// The timeout passed; these keys were still missing.
    Missing(Vec<String>),
    /// The cancel flag was raised.
    Cancelled,
}

pub(crate) fn parse_counter(key: &str, v: &[u8]) -> Result<i64> {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .ok_or_else(|| {
            Error::new(
                ErrorKind::Corrupt,
                format!("store key `{key}` does not hold an integer counter"),
            )
            .with_op("store add")
        })
}

/// `cur + delta` for the counter at `key`, or an error naming it.
pub(crate) fn counter_sum(key: &str, cur: i64, delta: i64) -> Result<i64> {
    cur.checked_add(delta).ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidArgument,
            format!("store counter `{key}` overflows"),
        )
        .with_op("store add")
    })
}

pub(crate) fn missing_keys_error(
    op: &str,
    missing: &[String],
    timeout: Duration,
    store: &str,
) -> Error {
    Error::timeout(
        op,
        timeout,
        format!("key(s) {} not set on {store}", missing.join(", ")),
    )
    .with_fix("check that every rank reached this point, or raise ACCEL_TIMEOUT")
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.lock().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        match self.wait_until(&[key], timeout) {
            Ok(map) => Ok(map[key].clone()),
            Err(missing) => Err(missing_keys_error(
                "store get",
                &missing,
                timeout,
                "the memory store",
            )),
        }
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.lock().get(key).cloned())
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut map = self.lock();
        let cur = match map.get(key) {
            Some(v) => parse_counter(key, v)?,
            None => 0,
        };
        let new = counter_sum(key, cur, delta)?;
        map.insert(key.to_string(), new.to_string().into_bytes());
        drop(map);
        self.changed.notify_all();
        Ok(new)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        let mut map = self.lock();
        let cur = map.get(key).map(|v| v.as_slice());
        if cur == expected {
            map.insert(key.to_string(), new.to_vec());
            drop(map);
            self.changed.notify_all();
            Ok(CasOutcome::Swapped)
        } else {
            Ok(CasOutcome::Current(cur.map(|v| v.to_vec())))
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_until(keys, timeout)
            .map(|_| ())
            .map_err(|missing| {
                missing_keys_error("store wait", &missing, timeout, "the memory store")
            })
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let existed = self.lock().remove(key).is_some();
        self.changed.notify_all();
        Ok(existed)
    }

    fn describe(&self) -> String {
        "memory store".to_string()
    }
}

#[cfg(test)]
mod tests;
