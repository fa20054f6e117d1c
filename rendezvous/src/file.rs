//! A store in a shared directory: one file per key.

use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use accel_api::{CasOutcome, Error, Result, Store};

use crate::memory::{counter_sum, missing_keys_error, parse_counter};

/// Longest path component the store writes (most filesystems allow 255).
const COMPONENT_MAX: usize = 200;
/// Longest pause between two polls of `get` / `wait`.
const POLL_MAX: Duration = Duration::from_millis(50);
/// Default bound on waiting for the lock file.
const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(30);

/// A store in a directory that every rank can see (a local tmp directory for
/// one machine, NFS or another shared filesystem for several), for runs
/// without a TCP server.
///
/// # Layout
///
/// * `keys/`: one file per key, holding the value. File names are the key
///   percent-encoded (bytes other than `A-Z a-z 0-9 _ -` become `%XX`; the
///   empty key is `%`), so no key can name a path outside the directory.
///   Encoded names longer than 200 bytes are split into nested directories
///   whose names end in `+`, which no encoded name does.
/// * `tmp/`: values being written.
/// * `lock`: the lock file.
///
/// # Consistency
///
/// Every write goes to a temporary file that is fsynced and then renamed
/// over the key's file, so readers see the old value or the new one, never
/// a part. `set`, `add`, `compare_set` and `delete` hold an exclusive
/// [`File::lock`] on the lock file (`flock` on Unix, released by the kernel
/// if the process dies), so they are atomic with respect to each other
/// across threads and processes. `get` and `wait` poll, backing off from
/// 1 ms to 50 ms, until their timeout. On NFS, attribute caching can delay
/// when a new key becomes visible on another machine by the mount's
/// `actimeo`.
///
/// Waiting for the lock is bounded too (30 s by default, see
/// [`with_lock_timeout`](FileStore::with_lock_timeout)): a process stopped
/// while holding it yields a timeout naming the lock file, not a hang.
///
/// There is no authentication: access is what the directory's permissions
/// allow. Deleted keys leave nested directories and the lock file behind;
/// remove the directory after the run.
#[derive(Debug, Clone)]
pub struct FileStore {
    root: PathBuf,
    keys: PathBuf,
    tmp: PathBuf,
    lock: PathBuf,
    lock_timeout: Duration,
}

/// Holds the lock file locked; unlocked (and closed) on drop.
struct LockGuard(File);

impl Drop for LockGuard {
    fn drop(&mut self) {
        let _ = self.0.unlock();
    }
}

fn encode_key(key: &str) -> String {
    if key.is_empty() {
        return "%".to_string();
    }
    let mut s = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            s.push(char::from(b));
        } else {
            let _ = write!(s, "%{b:02X}");
        }
    }
    s
}

/// The key's file relative to `keys/`.
fn key_rel_path(key: &str) -> PathBuf {
    let enc = encode_key(key);
    // `enc` is ASCII: slicing by bytes stays on char boundaries.
    let chunks: Vec<&str> = enc
        .as_bytes()
        .chunks(COMPONENT_MAX)
        .map(|c| std::str::from_utf8(c).unwrap_or_default())
        .collect();
    let mut p = PathBuf::new();
    for (i, c) in chunks.iter().enumerate() {
        if i + 1 < chunks.len() {
            p.push(format!("{c}+"));
        } else {
            p.push(c);
        }
    }
    p
}

fn unique_tmp_name() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{}.{n}.{nanos}.tmp", std::process::id())
}

impl FileStore {
    /// A store in `dir`, created if missing (a relative path is taken from
    /// the current directory). Every rank opens the same directory.
    ///
    /// # Errors
    /// [`ErrorKind::Io`](accel_api::ErrorKind::Io) naming the directory when it cannot be created or
    /// written.
    pub fn new(dir: impl AsRef<Path>) -> Result<FileStore> {
        let dir = dir.as_ref();
        let root = std::path::absolute(dir).map_err(|e| {
            Error::io(format!("invalid file store directory {}", dir.display()), e)
                .with_op("file store open")
        })?;
        let store = FileStore {
            keys: root.join("keys"),
            tmp: root.join("tmp"),
            lock: root.join("lock"),
            root,
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
        };
        let setup = fs::create_dir_all(&store.keys)
            .and_then(|()| fs::create_dir_all(&store.tmp))
            .and_then(|()| store.open_lock_file().map(drop));
        setup.map_err(|e| {
            Error::io(
                format!("cannot set up a file store in {}", store.root.display()),
                e,
            )
            .with_op("file store open")
            .with_fix("use a directory every rank can create and write files in")
        })?;
        Ok(store)
    }

    /// Bound the wait for the lock file (default 30 s).
    pub fn with_lock_timeout(mut self, timeout: Duration) -> FileStore {
        self.lock_timeout = timeout;
        self
    }

    /// The store's directory (absolute).
    pub fn dir(&self) -> &Path {
        &self.root
    }

    fn path(&self, key: &str) -> PathBuf {
        self.keys.join(key_rel_path(key))
    }

    fn open_lock_file(&self) -> io::Result<File> {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.lock)
    }

    /// Take the exclusive lock, polling up to the lock timeout.
    fn lock(&self, op: &str, key: &str) -> Result<LockGuard> {
        let f = self.open_lock_file().map_err(|e| {
            Error::io(format!("cannot open {}", self.lock.display()), e).with_op(op.to_string())
        })?;
        let start = Instant::now();
        let mut backoff = Duration::from_millis(1);
        loop {
            match f.try_lock() {
                Ok(()) => return Ok(LockGuard(f)),
                Err(TryLockError::WouldBlock) => {
                    let waited = start.elapsed();
                    if waited >= self.lock_timeout {
                        return Err(Error::timeout(
                            op.to_string(),
                            self.lock_timeout,
                            format!(
                                "could not lock {} for key `{key}`: another process holds it",
                                self.lock.display()
                            ),
                        )
                        .with_fix(
                            "a process of the run is stuck inside a store operation \
                             (stopped or hung); find it, or remove the store directory \
                             and restart the run",
                        ));
                    }
                    std::thread::sleep(backoff.min(self.lock_timeout - waited));
                    backoff = (backoff * 2).min(Duration::from_millis(20));
                }
                Err(TryLockError::Error(e)) => {
                    return Err(Error::io(
                        format!("cannot lock {} for key `{key}`", self.lock.display()),
                        e,
                    )
                    .with_op(op.to_string())
                    .with_fix("use a filesystem that supports file locks (flock)"));
                }
            }
        }
    }

    fn read(&self, op: &str, key: &str) -> Result<Option<Vec<u8>>> {
        let path = self.path(key);
        match fs::read(&path) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(
                format!("cannot read store key `{key}` from {}", path.display()),
                e,
            )
            .with_op(op.to_string())),
        }
    }

    fn exists(&self, op: &str, key: &str) -> Result<bool> {
        let path = self.path(key);
        match fs::metadata(&path) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::io(
                format!("cannot read store key `{key}` at {}", path.display()),
                e,
            )
            .with_op(op.to_string())),
        }
    }

    /// Write `value` to a temporary file, fsync it, rename it over the key.
    /// Call with the lock held.
    fn write(&self, op: &str, key: &str, value: &[u8]) -> Result<()> {
        let path = self.path(key);
        let tmp = self.tmp.join(unique_tmp_name());
        let res = (|| {
            if let Some(parent) = path.parent() {
                if parent != self.keys {
                    fs::create_dir_all(parent)?;
                }
            }
            let mut f = File::create_new(&tmp)?;
            f.write_all(value)?;
            f.sync_all()?;
            drop(f);
            fs::rename(&tmp, &path)
        })();
        if res.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        res.map_err(|e| {
            Error::io(
                format!("cannot write store key `{key}` to {}", path.display()),
                e,
            )
            .with_op(op.to_string())
        })
    }

    /// Poll until `ready` says every key is there or `timeout` passes.
    fn poll<T>(
        &self,
        op: &str,
        keys: &[&str],
        timeout: Duration,
        mut ready: impl FnMut() -> Result<std::result::Result<T, Vec<String>>>,
    ) -> Result<T> {
        let deadline = Instant::now().checked_add(timeout);
        let mut backoff = Duration::from_millis(1);
        loop {
            let missing = match ready()? {
                Ok(v) => return Ok(v),
                Err(missing) => missing,
            };
            let now = Instant::now();
            let left = match deadline {
                Some(d) if now >= d => {
                    let missing = if missing.is_empty() {
                        keys.iter().map(|k| k.to_string()).collect()
                    } else {
                        missing
                    };
                    return Err(missing_keys_error(op, &missing, timeout, &self.describe()));
                }
                Some(d) => d - now,
                None => POLL_MAX,
            };
            std::thread::sleep(backoff.min(left));
            backoff = (backoff * 2).min(POLL_MAX);
        }
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let _lock = self.lock("store set", key)?;
        self.write("store set", key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.poll("store get", &[key], timeout, || {
            Ok(self
                .read("store get", key)?
                .ok_or_else(|| vec![key.to_string()]))
        })
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.read("store try_get", key)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let _lock = self.lock("store add", key)?;
        let cur = match self.read("store add", key)? {
            Some(v) => parse_counter(key, &v)?,
            None => 0,
        };
        let new = counter_sum(key, cur, delta)?;
        self.write("store add", key, new.to_string().as_bytes())?;
        Ok(new)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        let _lock = self.lock("store compare_set", key)?;
        let cur = self.read("store compare_set", key)?;
        if cur.as_deref() == expected {
            self.write("store compare_set", key, new)?;
            Ok(CasOutcome::Swapped)
        } else {
            Ok(CasOutcome::Current(cur))
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.poll("store wait", keys, timeout, || {
            let mut missing = Vec::new();
            for k in keys {
                if !self.exists("store wait", k)? {
                    missing.push(k.to_string());
                }
            }
            Ok(if missing.is_empty() {
                Ok(())
            } else {
                Err(missing)
            })
        })
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let _lock = self.lock("store delete", key)?;
        let path = self.path(key);
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::io(
                format!("cannot delete store key `{key}` at {}", path.display()),
                e,
            )
            .with_op("store delete")),
        }
    }

    fn describe(&self) -> String {
        format!("file://{}", self.root.display())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::test_util::{self, TempDir};
    use accel_api::ErrorKind;
    use std::sync::Arc;

    #[test]
    fn key_names_cannot_escape_the_directory() {
        assert_eq!(encode_key("a/b"), "a%2Fb");
        assert_eq!(encode_key(".."), "%2E%2E");
        assert_eq!(encode_key(""), "%");
        assert_eq!(encode_key("r_1-x"), "r_1-x");
        let dir = TempDir::new("file-escape");
        let store = FileStore::new(dir.path().join("s")).unwrap();
        for k in [
            "../../escaped",
            "/etc/passwd",
            "..",
            ".",
            "a/../../b",
            "\0",
            "",
        ] {
            store.set(k, k.as_bytes()).unwrap();
            assert_eq!(store.try_get(k).unwrap().as_deref(), Some(k.as_bytes()));
        }
        // Nothing but the store directory was created next to it, and all
        // keys are plain files directly under keys/.
        let siblings: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(siblings.len(), 1);
        for entry in fs::read_dir(store.dir().join("keys")).unwrap() {
            let entry = entry.unwrap();
            assert!(entry.file_type().unwrap().is_file(), "{entry:?}");
        }
        assert_eq!(fs::read_dir(store.dir().join("keys")).unwrap().count(), 7);
    }

    #[test]
    fn long_keys_nest_without_colliding() {
        let dir = TempDir::new("file-long");
        let store = FileStore::new(dir.path()).unwrap();
        let long = "k".repeat(COMPONENT_MAX);
        let longer = format!("{long}x");
        let very = "é/".repeat(400);
        store.set(&long, b"1").unwrap();
        store.set(&longer, b"2").unwrap();
        store.set(&very, b"3").unwrap();
        assert_eq!(store.try_get(&long).unwrap(), Some(b"1".to_vec()));
        assert_eq!(store.try_get(&longer).unwrap(), Some(b"2".to_vec()));
        assert_eq!(store.try_get(&very).unwrap(), Some(b"3".to_vec()));
        assert!(store.path(&very).components().count() > 3);
        assert!(store.delete(&longer).unwrap());
        assert_eq!(store.try_get(&long).unwrap(), Some(b"1".to_vec()));
    }

    #[test]
    fn a_held_lock_times_out_naming_the_lock_file_and_key() {
        let dir = TempDir::new("file-lock");
        let store = FileStore::new(dir.path())
            .unwrap()
            .with_lock_timeout(Duration::from_millis(100));
        let holder = store.open_lock_file().unwrap();
        holder.lock().unwrap();
        let start = Instant::now();
        let e = store.add("counter", 1).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(2));
        assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
        let s = e.to_string();
        assert!(
            s.contains("counter") && s.contains(&store.lock.display().to_string()),
            "{s}"
        );
        // Reads do not need the lock.
        assert_eq!(store.try_get("counter").unwrap(), None);
        holder.unlock().unwrap();
        assert_eq!(store.add("counter", 1).unwrap(), 1);
    }

    #[test]
    fn unusable_directory_is_an_error_naming_it() {
        let dir = TempDir::new("file-bad");
        let file = dir.path().join("plain-file");
        fs::write(&file, b"x").unwrap();
        let e = FileStore::new(file.join("sub")).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Io), "{e}");
        assert!(e.to_string().contains("plain-file"), "{e}");
    }

    #[test]
    fn describe_is_a_file_url() {
        let dir = TempDir::new("file-describe");
        let store = FileStore::new(dir.path()).unwrap();
        assert_eq!(store.describe(), format!("file://{}", dir.path().display()));
        let e = store.get("nope", Duration::from_millis(10)).unwrap_err();
        assert!(
            e.to_string().contains("nope") && e.to_string().contains("file://"),
            "{e}"
        );
    }

    /// Two other processes and this one add to one counter and race for one
    /// compare_set.
    #[test]
    fn adds_are_atomic_across_processes() {
        const N: i64 = 40;
        let dir = TempDir::new("file-procs");
        let store = Arc::new(FileStore::new(dir.path()).unwrap());
        let children: Vec<_> = (0..2)
            .map(|i| {
                test_util::spawn_entry(
                    "file::tests::file_adder_child",
                    "file-adder",
                    &[
                        ("ACCEL_RDV_TEST_DIR", dir.path().to_str().unwrap()),
                        ("ACCEL_RDV_TEST_N", &N.to_string()),
                        ("ACCEL_RDV_TEST_ID", &format!("child{i}")),
                    ],
                )
            })
            .collect();
        let mine = child_adder(&store, N, "parent");
        let mut swapped = usize::from(mine);
        for c in children {
            let out = c.wait_output(Duration::from_secs(20));
            assert!(out.contains("ADDER_DONE"), "child output:\n{out}");
            if out.contains("ADDER_SWAPPED") {
                swapped += 1;
            }
        }
        assert_eq!(store.try_get("count").unwrap(), Some(b"120".to_vec()));
        assert_eq!(swapped, 1, "exactly one compare_set wins");
    }

    /// The children of `adds_are_atomic_across_processes`: a no-op in the
    /// normal test run.
    #[test]
    fn file_adder_child() {
        if test_util::child_role().as_deref() != Some("file-adder") {
            return;
        }
        let var = |k: &str| std::env::var(k).unwrap();
        let store = FileStore::new(var("ACCEL_RDV_TEST_DIR")).unwrap();
        let n: i64 = var("ACCEL_RDV_TEST_N").parse().unwrap();
        if child_adder(&store, n, &var("ACCEL_RDV_TEST_ID")) {
            println!("ADDER_SWAPPED");
        }
        println!("ADDER_DONE");
    }

    /// What each process of `adds_are_atomic_across_processes` does; `true`
    /// when its compare_set won.
    fn child_adder(store: &FileStore, n: i64, id: &str) -> bool {
        let won = store.compare_set("winner", None, id.as_bytes()).unwrap() == CasOutcome::Swapped;
        for _ in 0..n {
            store.add("count", 1).unwrap();
        }
        won
    }
}
