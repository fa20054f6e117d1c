//! A view of another store under a key prefix.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use accel_api::{CasOutcome, Result, Store};

/// Another store seen under a prefix: key `k` becomes `prefix/k`.
///
/// Independent users of one store (the runtime, each backend, each
/// sub-group, each restart of a run) take a prefix each so that they never
/// collide. Prefixes nest: a `PrefixStore` over a `PrefixStore` over `s`
/// with prefixes `a` then `b` stores `k` as `a/b/k` in `s`.
///
/// Trailing slashes of `prefix` are ignored; an empty prefix passes keys
/// through unchanged. Errors from the inner store name the full key.
/// [`describe`](Store::describe) appends the prefix to the inner store's
/// description: `tcp://10.0.0.1:29500/run1/gloo`.
#[derive(Clone)]
pub struct PrefixStore {
    inner: Arc<dyn Store>,
    prefix: String,
}

impl fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefixStore")
            .field("inner", &self.inner.describe())
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl PrefixStore {
    /// `inner` seen under `prefix`.
    pub fn new(inner: Arc<dyn Store>, prefix: impl Into<String>) -> PrefixStore {
        let mut prefix = prefix.into();
        while prefix.ends_with('/') {
            prefix.pop();
        }
        PrefixStore { inner, prefix }
    }

    /// The prefix, without its trailing `/`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The store underneath.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    fn key(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}/{key}", self.prefix)
        }
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key), timeout)
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.inner.try_get(&self.key(key))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        self.inner.compare_set(&self.key(key), expected, new)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&refs, timeout)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.key(key))
    }

    fn describe(&self) -> String {
        if self.prefix.is_empty() {
            self.inner.describe()
        } else {
            format!("{}/{}", self.inner.describe(), self.prefix)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;
    use accel_api::ErrorKind;

    #[test]
    fn keys_are_prefixed_and_prefixes_nest() {
        let mem = Arc::new(MemoryStore::new());
        let a: Arc<dyn Store> = Arc::new(PrefixStore::new(mem.clone(), "a/"));
        let ab = PrefixStore::new(a.clone(), "b");
        ab.set("k", b"1").unwrap();
        assert_eq!(mem.try_get("a/b/k").unwrap(), Some(b"1".to_vec()));
        assert_eq!(a.try_get("b/k").unwrap(), Some(b"1".to_vec()));
        assert_eq!(mem.try_get("k").unwrap(), None);
        assert_eq!(ab.add("n", 3).unwrap(), 3);
        assert_eq!(mem.try_get("a/b/n").unwrap(), Some(b"3".to_vec()));
        assert_eq!(
            ab.compare_set("n", Some(b"3"), b"4").unwrap(),
            CasOutcome::Swapped
        );
        ab.wait(&["k", "n"], Duration::from_millis(10)).unwrap();
        assert!(ab.delete("k").unwrap());
        assert_eq!(mem.try_get("a/b/k").unwrap(), None);
        assert_eq!(ab.describe(), "memory store/a/b");
        assert_eq!(ab.prefix(), "b");
        // Two prefixes over one store do not see each other.
        let other = PrefixStore::new(mem.clone(), "c");
        assert_eq!(other.try_get("b/n").unwrap(), None);
        // Empty prefix: pass-through.
        let none = PrefixStore::new(mem.clone(), "");
        assert_eq!(none.try_get("a/b/n").unwrap(), Some(b"4".to_vec()));
        assert_eq!(none.describe(), "memory store");
    }

    #[test]
    fn timeouts_name_the_full_key_and_the_prefix() {
        let mem: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let p = PrefixStore::new(Arc::new(PrefixStore::new(mem, "run7")), "gloo");
        let e = p.get("rank3", Duration::from_millis(20)).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("run7/gloo/rank3"), "{e}");
        let e = p.wait(&["x", "y"], Duration::from_millis(20)).unwrap_err();
        assert!(e.to_string().contains("run7/gloo/x, run7/gloo/y"), "{e}");
    }
}
