//! Behaviour every [`Store`] shares, as scenario functions; the
//! [`store_scenarios!`] macro stamps one `#[test]` per scenario for a store.

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_api::{CasOutcome, ErrorKind, Store, StoreExt};

/// A store under test, plus whatever must outlive it (server, directory).
pub(crate) struct Fixture {
    pub(crate) store: Arc<dyn Store>,
    /// What its errors must contain to name the store: its description, or
    /// for a prefix view the description of the store underneath.
    pub(crate) names: String,
    pub(crate) _keep: Box<dyn Any>,
}

impl Fixture {
    pub(crate) fn new(store: Arc<dyn Store>, keep: impl Any) -> Fixture {
        Fixture {
            names: store.describe(),
            store,
            _keep: Box::new(keep),
        }
    }

    /// `self` seen under `prefix` (nested twice, to cover nesting).
    pub(crate) fn prefixed(self, prefix: &str) -> Fixture {
        let inner = Arc::new(crate::PrefixStore::new(self.store.clone(), prefix));
        Fixture {
            store: Arc::new(crate::PrefixStore::new(inner, "sub/")),
            names: self.names.clone(),
            _keep: Box::new(self),
        }
    }
}

/// One `#[test]` per scenario, each on a fresh store from `$make`.
macro_rules! store_scenarios {
    ($make:expr) => {
        store_scenarios!(@each $make;
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
    (@each $make:expr; $($name:ident),*) => {
        $(
            #[test]
            fn $name() {
                let f: $crate::scenarios::Fixture = $make;
                $crate::scenarios::$name(&f);
            }
        )*
    };
}
pub(crate) use store_scenarios;

const LONG: Duration = Duration::from_secs(10);

pub(crate) fn set_get_overwrite(f: &Fixture) {
    let s = &f.store;
    s.set("k", &[0, 1, 255]).unwrap();
    assert_eq!(s.get("k", LONG).unwrap(), vec![0, 1, 255]);
    s.set("k", b"").unwrap();
    assert_eq!(s.get("k", LONG).unwrap(), b"");
    assert_eq!(s.try_get("k").unwrap(), Some(vec![]));
}

pub(crate) fn try_get_absent_is_none(f: &Fixture) {
    let s = &f.store;
    assert_eq!(s.try_get("absent").unwrap(), None);
}

pub(crate) fn get_waits_for_a_later_set(f: &Fixture) {
    let s = &f.store;
    let s2 = s.clone();
    let t = std::thread::spawn(move || s2.get("late", LONG));
    std::thread::sleep(Duration::from_millis(50));
    s.set("late", b"v").unwrap();
    assert_eq!(t.join().unwrap().unwrap(), b"v");
}

pub(crate) fn get_times_out_naming_the_key_and_store(f: &Fixture) {
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

pub(crate) fn wait_names_only_the_missing_keys(f: &Fixture) {
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

pub(crate) fn wait_returns_once_all_are_set(f: &Fixture) {
    let s = &f.store;
    s.set("w1", b"1").unwrap();
    let s2 = s.clone();
    let t = std::thread::spawn(move || s2.wait(&["w1", "w2"], LONG));
    std::thread::sleep(Duration::from_millis(50));
    s.set("w2", b"2").unwrap();
    t.join().unwrap().unwrap();
    s.wait(&[], Duration::ZERO).unwrap();
}

pub(crate) fn add_counts_and_rejects_non_integers(f: &Fixture) {
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
pub(crate) fn cas_steps(s: &dyn Store, key: &str, steps: &[(Option<&str>, &str, CasOutcome)]) {
    for (expected, new, outcome) in steps {
        let got = s.compare_set(key, expected.map(str::as_bytes), new.as_bytes());
        assert_eq!(
            &got.unwrap(),
            outcome,
            "compare_set({key:?}, {expected:?}, {new:?})"
        );
    }
}

pub(crate) fn compare_set_swaps_only_on_match(f: &Fixture) {
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

pub(crate) fn delete_reports_existence(f: &Fixture) {
    let s = &f.store;
    s.set("d", b"1").unwrap();
    assert!(s.delete("d").unwrap());
    assert!(!s.delete("d").unwrap());
    assert_eq!(s.try_get("d").unwrap(), None);
}

pub(crate) fn concurrent_adds_and_cas_are_atomic(f: &Fixture) {
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

pub(crate) fn odd_keys_are_distinct(f: &Fixture) {
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

pub(crate) fn barrier_releases_everyone(f: &Fixture) {
    let s = &f.store;
    crate::test_util::all_succeed(3, || {
        let s = s.clone();
        move || s.barrier("b", 3, LONG)
    });
    let e = s
        .barrier("lonely", 2, Duration::from_millis(30))
        .unwrap_err();
    assert!(e.to_string().contains("1 of 2"), "{e}");
}
