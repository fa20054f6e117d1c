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
        let new = cur.checked_add(delta).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("store counter `{key}` overflows"),
            )
        })?;
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
mod tests {
    use super::*;
    use accel_api::StoreExt;
    use std::sync::Arc;

    #[test]
    fn get_waits_for_a_later_set() {
        let s = Arc::new(MemoryStore::new());
        let s2 = s.clone();
        let t = std::thread::spawn(move || s2.get("k", Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(20));
        s.set("k", b"v").unwrap();
        assert_eq!(t.join().unwrap().unwrap(), b"v");
    }

    #[test]
    fn wait_times_out_naming_missing_keys() {
        let s = MemoryStore::new();
        s.set("a", b"1").unwrap();
        let e = s.wait(&["a", "b"], Duration::from_millis(30)).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Timeout { .. }));
        assert!(
            e.to_string().contains("b") && !e.to_string().contains("a,"),
            "{e}"
        );
    }

    #[test]
    fn add_cas_delete() {
        let s = MemoryStore::new();
        assert_eq!(s.add("c", 2).unwrap(), 2);
        assert_eq!(s.add("c", -5).unwrap(), -3);
        s.set("x", b"zz").unwrap();
        assert!(matches!(
            s.add("x", 1).unwrap_err().kind(),
            ErrorKind::Corrupt
        ));
        let steps = [
            (None, "1", CasOutcome::Swapped),
            (None, "2", CasOutcome::Current(Some(b"1".to_vec()))),
            (Some("1"), "2", CasOutcome::Swapped),
        ];
        crate::scenarios::cas_steps(&s, "n", &steps);
        assert!(s.delete("n").unwrap());
        assert!(!s.delete("n").unwrap());
    }

    #[test]
    fn huge_timeouts_do_not_overflow() {
        let s = MemoryStore::new();
        s.set("k", b"v").unwrap();
        assert_eq!(s.get("k", Duration::MAX).unwrap(), b"v");
        s.wait(&["k"], Duration::MAX).unwrap();
    }

    #[test]
    fn cancellable_waits_end_when_woken() {
        let s = Arc::new(MemoryStore::new());
        let cancel = Arc::new(AtomicBool::new(false));
        let (s2, c2) = (s.clone(), cancel.clone());
        let t = std::thread::spawn(move || {
            let start = Instant::now();
            let r = s2.get_or_cancel("never", Duration::from_secs(20), &c2);
            (matches!(r, Waited::Cancelled), start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(50));
        cancel.store(true, Ordering::SeqCst);
        s.wake_waiters();
        let (cancelled, took) = t.join().unwrap();
        assert!(cancelled);
        assert!(took < Duration::from_secs(5), "{took:?}");
        // Not cancelled: the usual answers.
        let off = AtomicBool::new(false);
        s.set("a", b"1").unwrap();
        assert!(matches!(
            s.wait_or_cancel(&["a"], Duration::ZERO, &off),
            Waited::Ready(())
        ));
        match s.wait_or_cancel(&["a", "b"], Duration::from_millis(10), &off) {
            Waited::Missing(m) => assert_eq!(m, vec!["b".to_string()]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn barrier_releases_all_and_reports_stragglers() {
        let s = Arc::new(MemoryStore::new());
        crate::test_util::all_succeed(3, || {
            let s = s.clone();
            move || s.barrier("b1", 3, Duration::from_secs(5))
        });
        let e = s.barrier("b2", 2, Duration::from_millis(20)).unwrap_err();
        assert!(e.to_string().contains("1 of 2"), "{e}");
    }
}
