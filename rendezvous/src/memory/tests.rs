//! The memory store's own tests (the shared ones: `lib.rs`'s
//! `memory_scenarios`).

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
    crate::testkit::cas_steps(&s, "n", &steps);
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
    crate::testkit::all_succeed(3, || {
        let s = s.clone();
        move || s.barrier("b1", 3, Duration::from_secs(5))
    });
    let e = s.barrier("b2", 2, Duration::from_millis(20)).unwrap_err();
    assert!(e.to_string().contains("1 of 2"), "{e}");
}
