use std::collections::HashMap;
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

    /// Wait until `ready(map)` holds, up to `timeout`; `Err(missing keys)` after.
    fn wait_until(
        &self,
        keys: &[&str],
        timeout: Duration,
    ) -> std::result::Result<MutexGuard<'_, HashMap<String, Vec<u8>>>, Vec<String>> {
        let deadline = Instant::now() + timeout;
        let mut map = self.lock();
        loop {
            if keys.iter().all(|k| map.contains_key(*k)) {
                return Ok(map);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(keys
                    .iter()
                    .filter(|k| !map.contains_key(**k))
                    .map(|k| k.to_string())
                    .collect());
            }
            map = self
                .changed
                .wait_timeout(map, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
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

    fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<CasOutcome> {
        let mut map = self.lock();
        let cur = map.get(key).map(|v| v.as_slice());
        if cur == expected {
            map.insert(key.to_string(), desired.to_vec());
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
        assert_eq!(s.compare_set("n", None, b"1").unwrap(), CasOutcome::Swapped);
        assert_eq!(
            s.compare_set("n", None, b"2").unwrap(),
            CasOutcome::Current(Some(b"1".to_vec()))
        );
        assert_eq!(
            s.compare_set("n", Some(b"1"), b"2").unwrap(),
            CasOutcome::Swapped
        );
        assert!(s.delete("n").unwrap());
        assert!(!s.delete("n").unwrap());
    }

    #[test]
    fn barrier_releases_all_and_reports_stragglers() {
        let s = Arc::new(MemoryStore::new());
        let hs: Vec<_> = (0..3)
            .map(|_| {
                let s = s.clone();
                std::thread::spawn(move || s.barrier("b1", 3, Duration::from_secs(5)))
            })
            .collect();
        for h in hs {
            h.join().unwrap().unwrap();
        }
        let e = s.barrier("b2", 2, Duration::from_millis(20)).unwrap_err();
        assert!(e.to_string().contains("1 of 2"), "{e}");
    }
}
