//! A rendezvous store in a directory, shared by processes on one machine:
//! one file per key, written atomically (temporary file + rename), with a
//! lock file for read-modify-write. Test and example scaffolding until the
//! launcher's TCP store is available; polling, so only for small runs.

use std::fs;
use std::io::ErrorKind as IoKind;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use accel_api::{CasOutcome, Error, ErrorKind, Result, Store};

const POLL: Duration = Duration::from_millis(2);

/// See the module docs.
#[derive(Debug)]
pub struct DirStore {
    dir: PathBuf,
    seq: AtomicU64,
}

impl DirStore {
    /// A store in `dir` (created if missing).
    pub fn new(dir: impl AsRef<Path>) -> Result<DirStore> {
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        Ok(DirStore {
            dir,
            seq: AtomicU64::new(0),
        })
    }

    fn path(&self, key: &str) -> PathBuf {
        let name: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        self.dir.join(format!("k{name}"))
    }

    fn write(&self, key: &str, value: &[u8]) -> Result<()> {
        let tmp = self.dir.join(format!(
            "tmp.{}.{}",
            std::process::id(),
            self.seq.fetch_add(1, Ordering::Relaxed)
        ));
        fs::write(&tmp, value).map_err(|e| Error::io("store write", e))?;
        fs::rename(&tmp, self.path(key)).map_err(|e| Error::io("store rename", e))
    }

    fn locked<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let lock = self.dir.join("lock");
        let start = Instant::now();
        loop {
            match fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&lock)
            {
                Ok(_) => break,
                Err(e) if e.kind() == IoKind::AlreadyExists => {
                    if start.elapsed() > Duration::from_secs(10) {
                        return Err(Error::timeout("store lock", start.elapsed(), "lock held"));
                    }
                    std::thread::sleep(POLL);
                }
                Err(e) => return Err(Error::io("store lock", e)),
            }
        }
        let r = f();
        let _ = fs::remove_file(&lock);
        r
    }
}

impl Store for DirStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.write(key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait(&[key], timeout)?;
        self.try_get(key)?
            .ok_or_else(|| Error::new(ErrorKind::Io, format!("key `{key}` vanished")))
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match fs::read(self.path(key)) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.kind() == IoKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("store read", e)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.locked(|| {
            let cur = match self.try_get(key)? {
                Some(v) => String::from_utf8_lossy(&v).parse::<i64>().map_err(|_| {
                    Error::new(ErrorKind::Corrupt, format!("`{key}` is not a counter"))
                })?,
                None => 0,
            };
            let new = cur + delta;
            self.write(key, new.to_string().as_bytes())?;
            Ok(new)
        })
    }

    fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<CasOutcome> {
        self.locked(|| {
            let cur = self.try_get(key)?;
            if cur.as_deref() == expected {
                self.write(key, desired)?;
                Ok(CasOutcome::Swapped)
            } else {
                Ok(CasOutcome::Current(cur))
            }
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            let missing: Vec<&str> = keys
                .iter()
                .copied()
                .filter(|k| !self.path(k).exists())
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                return Err(Error::timeout(
                    "store wait",
                    timeout,
                    format!(
                        "key(s) {} not set in {}",
                        missing.join(", "),
                        self.describe()
                    ),
                ));
            }
            std::thread::sleep(POLL);
        }
    }

    fn delete(&self, key: &str) -> Result<bool> {
        match fs::remove_file(self.path(key)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == IoKind::NotFound => Ok(false),
            Err(e) => Err(Error::io("store delete", e)),
        }
    }

    fn describe(&self) -> String {
        format!("file://{}", self.dir.display())
    }
}
