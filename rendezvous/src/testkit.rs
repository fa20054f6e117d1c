//! Behaviour every [`Store`] shares, as scenario functions a store's own
//! tests run (feature `testkit`): the
//! [`store_scenarios!`](crate::store_scenarios) macro stamps one `#[test]`
//! per scenario, each on a fresh [`Fixture`].
//! Every store of this crate passes them; a third-party store (a plugin's,
//! a vendor's) proves itself the same way:
//!
//! ```
//! mod my_store {
//!     use std::sync::Arc;
//!     use accel_rendezvous::testkit::Fixture;
//!     # use accel_rendezvous::MemoryStore as MyStore;
//!     // The second argument outlives the store (a server, a folder).
//!     accel_rendezvous::store_scenarios!(Fixture::new(Arc::new(MyStore::new()), ()));
//! }
//! ```
//!
//! Each scenario panics on what it finds wrong. A store's errors must name
//! the key and the store ([`Fixture::names`]).

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_api::{CasOutcome, ErrorKind, Store, StoreExt};

/// A store under test, plus whatever must outlive it (server, directory).
pub struct Fixture {
    /// The store the scenario calls.
    pub store: Arc<dyn Store>,
    /// What its errors must contain to name the store: its description, or
    /// for a prefix view the description of the store underneath.
    pub names: String,
    _keep: Box<dyn Any>,
}

impl std::fmt::Debug for Fixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fixture")
            .field("store", &self.store.describe())
            .field("names", &self.names)
            .finish_non_exhaustive()
    }
}

impl Fixture {
    /// `store`, named by its own description, keeping `keep` alive as long
    /// as the fixture.
    pub fn new(store: Arc<dyn Store>, keep: impl Any) -> Fixture {
        Fixture {
            names: store.describe(),
            store,
            _keep: Box::new(keep),
        }
    }

    /// `self` seen under `prefix` (nested twice, to cover nesting) through
    /// [`PrefixStore`](crate::PrefixStore); its errors still name the
    /// store underneath.
    pub fn prefixed(self, prefix: &str) -> Fixture {
        let inner = Arc::new(crate::PrefixStore::new(self.store.clone(), prefix));
        Fixture {
            store: Arc::new(crate::PrefixStore::new(inner, "sub/")),
            names: self.names.clone(),
            _keep: Box::new(self),
        }
    }
}

/// One `#[test]` per [`testkit`](crate::testkit) scenario, each on a fresh
/// store from `$make` (an expression of type
/// [`Fixture`](crate::testkit::Fixture)). Stamp it into a module of its
/// own per store: the tests are named as the scenarios.
#[macro_export]
macro_rules! store_scenarios {
    // A store that may be absent here (a server not installed): `$make`
    // is an `Option<Fixture>`, `None` after the caller recorded a skip.
    (optional $make:expr) => {
        $crate::store_scenarios!(@names optional $make);
    };
    ($make:expr) => {
        $crate::store_scenarios!(@names required $make);
    };
    (@names $mode:ident $make:expr) => {
        $crate::store_scenarios!(@each $mode $make;
            set_get_overwrite,
            try_get_absent_is_none,
            get_waits_for_a_later_set,
            get_times_out_naming_the_key_and_store,
            wait_names_only_the_missing_keys,
            wait_returns_once_all_are_set,
            add_counts_and_rejects_non_integers,
            compare_set_swaps_only_on_match,
            delete_reports_existence,
            concurrent_adds_and_cas_are_atomic,
            odd_keys_are_distinct,
            barrier_releases_everyone);
    };
    (@each required $make:expr; $($name:ident),*) => {
        $(
            #[test]
            fn $name() {
                let f: $crate::testkit::Fixture = $make;
                $crate::testkit::$name(&f);
            }
        )*
    };
    (@each optional $make:expr; $($name:ident),*) => {
        $(
            #[test]
            fn $name() {
                let f: Option<$crate::testkit::Fixture> = $make;
                if let Some(f) = f {
                    $crate::testkit::$name(&f);
                }
            }
        )*
    };
}

/// Run `n` threads, each running what one call of `make` returns, and wait
/// for all of them: each must return `Ok` (a panic or an error fails the
/// caller).
pub fn all_succeed<T, F>(n: usize, make: impl Fn() -> F)
where
    F: FnOnce() -> accel_api::Result<T> + Send + 'static,
    T: Send + 'static,
{
    let hs: Vec<_> = (0..n).map(|_| std::thread::spawn(make())).collect();
    for h in hs {
        h.join().unwrap().unwrap();
    }
}

const LONG: Duration = Duration::from_secs(10);

/// A set value reads back, an overwrite replaces it, an empty value is a value.
pub fn set_get_overwrite(f: &Fixture) {
    let s = &f.store;
    s.set("k", &[0, 1, 255]).unwrap();
    assert_eq!(s.get("k", LONG).unwrap(), vec![0, 1, 255]);
    s.set("k", b"").unwrap();
    assert_eq!(s.get("k", LONG).unwrap(), b"");
    assert_eq!(s.try_get("k").unwrap(), Some(vec![]));
}

/// An absent key is `None`, not an error.
pub fn try_get_absent_is_none(f: &Fixture) {
    let s = &f.store;
    assert_eq!(s.try_get("absent").unwrap(), None);
}

/// A `get` waits for a set from another thread.
pub fn get_waits_for_a_later_set(f: &Fixture) {
    let s = &f.store;
    let s2 = s.clone();
    let t = std::thread::spawn(move || s2.get("late", LONG));
    std::thread::sleep(Duration::from_millis(50));
    s.set("late", b"v").unwrap();
    assert_eq!(t.join().unwrap().unwrap(), b"v");
}

/// A `get` of an absent key times out after its timeout (not long after), with
/// a `Timeout` naming the key and the store; the store works afterwards.
pub fn get_times_out_naming_the_key_and_store(f: &Fixture) {
    let s = &f.store;
    let start = Instant::now();
    let e = s.get("absent-key", Duration::from_millis(60)).unwrap_err();
    let took = start.elapsed();
    assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
    assert!(took >= Duration::from_millis(60), "{took:?}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    let m = e.to_string();
    assert!(m.contains("absent-key") && m.contains(&f.names), "{m}");
    // The store still works afterwards.
    s.set("absent-key", b"1").unwrap();
    assert_eq!(s.get("absent-key", LONG).unwrap(), b"1");
}

/// A `wait` that times out names the keys still missing, not the present ones.
pub fn wait_names_only_the_missing_keys(f: &Fixture) {
    let s = &f.store;
    s.set("present-key", b"1").unwrap();
    let e = s
        .wait(&["present-key", "missing-key"], Duration::from_millis(50))
        .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
    let m = e.to_string();
    assert!(
        m.contains("missing-key") && !m.contains("present-key"),
        "{m}"
    );
}

/// A `wait` returns once every key is set; a `wait` for no key returns at once.
pub fn wait_returns_once_all_are_set(f: &Fixture) {
    let s = &f.store;
    s.set("w1", b"1").unwrap();
    let s2 = s.clone();
    let t = std::thread::spawn(move || s2.wait(&["w1", "w2"], LONG));
    std::thread::sleep(Duration::from_millis(50));
    s.set("w2", b"2").unwrap();
    t.join().unwrap().unwrap();
    s.wait(&[], Duration::ZERO).unwrap();
}

/// `add` counts from 0; a non-integer value is `Corrupt` naming the key and
/// stays; an overflow is an error naming the key.
pub fn add_counts_and_rejects_non_integers(f: &Fixture) {
    let s = &f.store;
    assert_eq!(s.add("c", 5).unwrap(), 5);
    assert_eq!(s.add("c", -7).unwrap(), -2);
    assert_eq!(s.get("c", LONG).unwrap(), b"-2");
    s.set("not-a-number", b"abc").unwrap();
    let e = s.add("not-a-number", 1).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Corrupt), "{e}");
    assert!(e.to_string().contains("not-a-number"), "{e}");
    assert_eq!(s.get("not-a-number", LONG).unwrap(), b"abc");
    s.set("big", i64::MAX.to_string().as_bytes()).unwrap();
    let e = s.add("big", 1).unwrap_err();
    assert!(e.to_string().contains("big"), "{e}");
}

/// `compare_set(key, expected, new)` on `s`, one step after another, each
/// with the outcome given.
#[track_caller]
pub fn cas_steps(s: &dyn Store, key: &str, steps: &[(Option<&str>, &str, CasOutcome)]) {
    for (expected, new, outcome) in steps {
        let got = s.compare_set(key, expected.map(str::as_bytes), new.as_bytes());
        assert_eq!(
            &got.unwrap(),
            outcome,
            "compare_set({key:?}, {expected:?}, {new:?})"
        );
    }
}

/// `compare_set` swaps only when the current value is the expected one (absence
/// included) and otherwise reports the current value.
pub fn compare_set_swaps_only_on_match(f: &Fixture) {
    let s = &f.store;
    let one = || CasOutcome::Current(Some(b"1".to_vec()));
    let steps = [
        (None, "1", CasOutcome::Swapped),
        (None, "2", one()),
        (Some("9"), "2", one()),
        (Some("1"), "2", CasOutcome::Swapped),
    ];
    cas_steps(&**s, "n", &steps);
    assert_eq!(s.try_get("n").unwrap(), Some(b"2".to_vec()));
    cas_steps(
        &**s,
        "absent",
        &[(Some("1"), "2", CasOutcome::Current(None))],
    );
    assert_eq!(s.try_get("absent").unwrap(), None);
}

/// `delete` says whether the key existed, and removes it.
pub fn delete_reports_existence(f: &Fixture) {
    let s = &f.store;
    s.set("d", b"1").unwrap();
    assert!(s.delete("d").unwrap());
    assert!(!s.delete("d").unwrap());
    assert_eq!(s.try_get("d").unwrap(), None);
}

/// Concurrent `add`s lose no count, and of concurrent `compare_set`s on an
/// absent key exactly one wins.
pub fn concurrent_adds_and_cas_are_atomic(f: &Fixture) {
    let s = &f.store;
    let threads = 4;
    let per = 25;
    let hs: Vec<_> = (0..threads)
        .map(|i| {
            let s = s.clone();
            std::thread::spawn(move || {
                let won = s
                    .compare_set("owner", None, format!("t{i}").as_bytes())
                    .unwrap()
                    == CasOutcome::Swapped;
                for _ in 0..per {
                    s.add("counter", 1).unwrap();
                }
                won
            })
        })
        .collect();
    let winners = hs
        .into_iter()
        .map(|h| h.join().unwrap())
        .filter(|won| *won)
        .count();
    assert_eq!(winners, 1);
    assert_eq!(
        s.try_get("counter").unwrap(),
        Some((threads * per).to_string().into_bytes())
    );
}

/// Keys that a naive encoding would confuse (empty, slashes, escapes, dots,
/// non-ASCII, spaces, newlines, long) are distinct keys.
pub fn odd_keys_are_distinct(f: &Fixture) {
    let s = &f.store;
    let long = "x".repeat(500);
    let keys = [
        "",
        "a",
        "a/b",
        "a%2Fb",
        "a%2fb",
        "../x",
        "./x",
        ".",
        "..",
        "ü",
        "with space",
        "a\nb",
        &long,
    ];
    for (i, k) in keys.iter().enumerate() {
        s.set(k, i.to_string().as_bytes()).unwrap();
    }
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(
            s.try_get(k).unwrap(),
            Some(i.to_string().into_bytes()),
            "key {k:?}"
        );
    }
}

/// `StoreExt::barrier` releases every party once all arrive; one alone times
/// out saying how many arrived.
pub fn barrier_releases_everyone(f: &Fixture) {
    let s = &f.store;
    all_succeed(3, || {
        let s = s.clone();
        move || s.barrier("b", 3, LONG)
    });
    let e = s
        .barrier("lonely", 2, Duration::from_millis(30))
        .unwrap_err();
    assert!(e.to_string().contains("1 of 2"), "{e}");
}
