use std::time::{Duration, Instant};

use crate::{Error, ErrorKind, Result};

/// The outcome of [`Store::compare_set`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CasOutcome {
    /// The value was `expected` (or absent, when `None` was expected) and is
    /// now `new`.
    Swapped,
    /// The value was something else and was left unchanged; this is what it
    /// holds (`None`: the key is absent).
    Current(Option<Vec<u8>>),
}

/// The rendezvous key-value store every engine bootstraps from.
///
/// All ranks of a run share one store (TCP hosted by the launcher or rank 0,
/// a file, memory in tests), usually seen through a prefix so that
/// independent users never collide. Keys are UTF-8 strings, values bytes.
///
/// Every blocking method takes its bound explicitly; none blocks forever.
///
/// # Errors common to every method
/// * [`ErrorKind::Timeout`]: the bound passed, naming the key(s) still missing.
/// * [`ErrorKind::Io`] / [`ErrorKind::PeerLost`]: the store server went away.
/// * [`ErrorKind::Unauthorized`]: the server refused this client's token.
pub trait Store: Send + Sync {
    /// Set `key` to `value`, replacing any previous value, and wake waiters.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The value of `key`, waiting up to `timeout` for it to be set.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;

    /// The value of `key` if it is set, without waiting.
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// Atomically add `delta` to the integer at `key` (absent = 0) and return
    /// the new value. The value is stored as decimal ASCII.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] when the key holds something else than an integer.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Atomically replace the value of `key` with `new` if it currently
    /// equals `expected` (`None`: the key is absent).
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome>;

    /// Wait until every key in `keys` is set, up to `timeout`.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;

    /// Remove `key`; `true` if it existed.
    fn delete(&self, key: &str) -> Result<bool>;

    /// A short description for errors and logs (`tcp://127.0.0.1:29500`).
    fn describe(&self) -> String;
}

impl<S: Store + ?Sized> Store for std::sync::Arc<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        (**self).set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        (**self).get(key, timeout)
    }
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        (**self).try_get(key)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        (**self).add(key, delta)
    }
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        (**self).compare_set(key, expected, new)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        (**self).wait(keys, timeout)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        (**self).delete(key)
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
}

/// Conveniences over any [`Store`], provided for free.
pub trait StoreExt: Store {
    /// [`Store::get`] decoded as UTF-8.
    ///
    /// # Errors
    /// As `get`, plus [`ErrorKind::Corrupt`] when the value is not UTF-8.
    fn get_string(&self, key: &str, timeout: Duration) -> Result<String> {
        let v = self.get(key, timeout)?;
        String::from_utf8(v).map_err(|_| {
            Error::new(
                ErrorKind::Corrupt,
                format!("store key `{key}` does not hold UTF-8 text"),
            )
        })
    }

    /// A store-only barrier among `world_size` participants named `name`
    /// (each distinct barrier needs a distinct name). Returns once all
    /// `world_size` callers arrived, or fails after `timeout` saying how many
    /// arrived.
    fn barrier(&self, name: &str, world_size: usize, timeout: Duration) -> Result<()> {
        let count_key = format!("{name}/arrived");
        let done_key = format!("{name}/done");
        let arrived = self.add(&count_key, 1)?;
        if arrived as usize >= world_size {
            self.set(&done_key, b"1")?;
        }
        let start = Instant::now();
        match self.wait(&[&done_key], timeout) {
            Ok(()) => Ok(()),
            Err(e) if matches!(e.kind(), ErrorKind::Timeout { .. }) => {
                let now = self
                    .try_get(&count_key)
                    .ok()
                    .flatten()
                    .and_then(|v| String::from_utf8(v).ok())
                    .unwrap_or_else(|| "?".into());
                Err(Error::timeout(
                    "store barrier",
                    start.elapsed().max(timeout),
                    format!(
                        "barrier `{name}`: {now} of {world_size} participants arrived on {}",
                        self.describe()
                    ),
                )
                .with_fix("check that every rank started and reached this point"))
            }
            Err(e) => Err(e),
        }
    }
}

impl<S: Store + ?Sized> StoreExt for S {}
