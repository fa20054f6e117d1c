use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_api::{ErrorKind, Store};

use super::wire::{self, q, Msg};
use super::{TorchServerLimits, TorchStore, TorchStoreServer};
use crate::store_scenarios;
use crate::testkit::Fixture;

const T: Duration = Duration::from_secs(5);

fn server() -> TorchStoreServer {
    TorchStoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap()
}

fn client(s: &TorchStoreServer) -> TorchStore {
    TorchStore::connect(s.local_addr(), T).unwrap()
}

mod scenarios_on_our_server {
    use super::*;
    store_scenarios!({
        let s = server();
        Fixture::new(Arc::new(client(&s)), s)
    });
}

/// A raw connection that has validated.
fn raw(s: &TorchStoreServer) -> TcpStream {
    let mut c = TcpStream::connect(s.local_addr()).unwrap();
    c.set_read_timeout(Some(T)).unwrap();
    c.write_all(&Msg::new(q::VALIDATE).u32(wire::MAGIC).into_bytes())
        .unwrap();
    c
}

/// The server closed `c` within `bound`: end of stream or a reset. A reply
/// (the stranger was served) or silence until the bound is not a close.
fn closed_within(c: &mut TcpStream, bound: Duration) -> bool {
    c.set_read_timeout(Some(bound)).unwrap();
    let mut b = [0u8; 16];
    match c.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

#[test]
fn the_extended_operations_follow_torchs_semantics() {
    let s = server();
    let c = client(&s);
    c.set("a", b"1").unwrap();
    c.append("a", b"23").unwrap();
    assert_eq!(c.get("a", T).unwrap(), b"123");
    c.multi_set(&[("m1", b"x"), ("m2", b"")]).unwrap();
    assert_eq!(
        c.multi_get(&["m1", "m2", "a"], T).unwrap(),
        vec![b"x".to_vec(), vec![], b"123".to_vec()]
    );
    assert!(c.check(&["a", "m2"]).unwrap());
    assert!(!c.check(&["a", "nope"]).unwrap());
    assert_eq!(c.num_keys().unwrap(), 3);
    let mut keys = c.list_keys().unwrap();
    keys.sort();
    assert_eq!(keys, ["a", "m1", "m2"]);
    assert!(c.ping().unwrap() < T);

    assert_eq!(c.queue_len("q").unwrap(), 0);
    assert_eq!(c.queue_pop("q", None).unwrap(), None);
    c.queue_push("q", b"first").unwrap();
    c.queue_push("q", b"second").unwrap();
    assert_eq!(c.queue_len("q").unwrap(), 2);
    assert!(c.check(&["q"]).unwrap(), "a non-empty queue is ready");
    assert_eq!(c.queue_pop("q", None).unwrap().unwrap(), b"first");
    assert_eq!(c.queue_pop("q", Some(T)).unwrap().unwrap(), b"second");
    let e = c
        .queue_pop("q", Some(Duration::from_millis(50)))
        .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
    // A blocked pop is woken by a push from another client.
    let c2 = client(&s);
    let t = std::thread::spawn(move || c2.queue_pop("q2", Some(T)));
    std::thread::sleep(Duration::from_millis(50));
    c.queue_push("q2", b"late").unwrap();
    assert_eq!(t.join().unwrap().unwrap().unwrap(), b"late");

    // The server-side barrier.
    crate::testkit::all_succeed(3, || {
        let c = client(&s);
        move || c.server_barrier("bar", 3, T)
    });
    let e = c
        .server_barrier("lonely", 2, Duration::from_millis(50))
        .unwrap_err();
    assert!(e.to_string().contains("1 of 2"), "{e}");
}

#[test]
fn a_wait_that_times_out_is_cancelled_and_the_connection_stays_usable() {
    let s = server();
    let c = client(&s);
    for _ in 0..3 {
        let start = Instant::now();
        let e = c.wait(&["never"], Duration::from_millis(40)).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
        assert!(start.elapsed() < Duration::from_secs(2));
    }
    // The cancelled waits left no waiter behind: a later set wakes nothing
    // stale, and the pooled connections answer the next wait correctly.
    c.set("never", b"now").unwrap();
    c.wait(&["never"], T).unwrap();
    assert_eq!(c.get("never", T).unwrap(), b"now");
}

#[test]
fn a_client_that_dies_mid_wait_leaves_the_server_serving_the_others() {
    let s = server();
    let mut dying = raw(&s);
    dying
        .write_all(&Msg::new(q::WAIT).count(1).bytes(b"/k").into_bytes())
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(dying);
    let c = client(&s);
    let c2 = client(&s);
    let t = std::thread::spawn(move || c2.get("k", T));
    std::thread::sleep(Duration::from_millis(50));
    c.set("k", b"v").unwrap();
    assert_eq!(t.join().unwrap().unwrap(), b"v");
}

#[test]
fn strangers_are_closed_and_never_served() {
    let s = server();
    // accel's own protocol, an HTTP probe, a wrong magic: closed at once.
    for hello in [
        &b"\x10\x00\x00\x00\x01ACCELRDV"[..],
        b"GET / HTTP/1.1\r\n\r\n",
        &Msg::new(q::VALIDATE).u32(1).into_bytes(),
    ] {
        let mut c = TcpStream::connect(s.local_addr()).unwrap();
        c.write_all(hello).unwrap();
        assert!(closed_within(&mut c, T), "{hello:?} was not closed");
    }
    // A query before validating is not served.
    let mut c = TcpStream::connect(s.local_addr()).unwrap();
    c.write_all(&Msg::new(q::PING).u32(5).into_bytes()).unwrap();
    assert!(closed_within(&mut c, T));
    // A key over torch's limit closes the connection; others go on.
    let mut big = raw(&s);
    big.write_all(
        &Msg::new(q::GET)
            .bytes(&vec![b'k'; wire::MAX_KEY as usize + 1])
            .into_bytes(),
    )
    .unwrap();
    assert!(closed_within(&mut big, T));
    client(&s).ping().unwrap();
}

#[test]
fn silent_and_trickling_clients_are_closed_by_the_limits() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let limits = TorchServerLimits {
        validate_timeout: Duration::from_millis(300),
        request_timeout: Duration::from_millis(300),
        ..TorchServerLimits::default()
    };
    let s = TorchStoreServer::from_listener(l, limits).unwrap();
    let mut silent = TcpStream::connect(s.local_addr()).unwrap();
    let mut trickle = raw(&s);
    // Half a set, then nothing.
    trickle.write_all(&[q::SET, 1, 0]).unwrap();
    let start = Instant::now();
    assert!(closed_within(&mut silent, T));
    assert!(closed_within(&mut trickle, T));
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    // A validated client that is idle between requests is not a trickler.
    let c = client(&s);
    std::thread::sleep(Duration::from_millis(700));
    c.set("still", b"here").unwrap();
    assert_eq!(c.get("still", T).unwrap(), b"here");
}

#[test]
fn a_client_fails_promptly_when_the_server_goes_away() {
    let s = server();
    let c = client(&s);
    c.set("k", b"v").unwrap();
    let c = Arc::new(c);
    let c2 = c.clone();
    let t = std::thread::spawn(move || c2.get("missing", Duration::from_secs(30)));
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    s.shutdown();
    let e = t.join().unwrap().unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert!(e.to_string().contains(&s.local_addr().to_string()), "{e}");
    assert!(c.try_get("k").is_err());
}

#[test]
fn connect_retries_until_a_late_server_starts_and_names_a_missing_one() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    let t = std::thread::spawn(move || TorchStore::connect(addr, Duration::from_secs(10)));
    std::thread::sleep(Duration::from_millis(300));
    let s = TorchStoreServer::bind(addr).unwrap();
    let c = t.join().unwrap().unwrap();
    c.set("k", b"v").unwrap();
    drop(s);
    let start = Instant::now();
    let e = TorchStore::connect(addr, Duration::from_millis(300)).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
}

#[test]
fn oversized_writes_are_refused_before_sending() {
    let s = server();
    let c = client(&s);
    let e = c
        .set("k", &vec![0u8; wire::MAX_VALUE as usize + 1])
        .unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
    c.set("k", b"fine").unwrap();
    assert_eq!(c.get("k", T).unwrap(), b"fine");
}
