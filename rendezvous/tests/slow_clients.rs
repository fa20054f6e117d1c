//! A flood of slow, silent and half-open connections without a token does
//! not lock real clients out of the TCP store, does not cost a thread per
//! connection, and does not flood the log (issue 22, item 6).
//!
//! Loopback only, bounded in count (3,000 connections, fewer when the
//! open-file limit cannot be raised far enough) and in time (a watchdog
//! ends the process after 120 s).

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use accel_api::Store;
use accel_rendezvous::{ServerLimits, TcpStore, TcpStoreServer};

const TOKEN: &str = "flood-test-token";
/// Connections the attackers try to hold open at once.
const FLOOD: u64 = 3000;
const ATTACKERS: u64 = 4;
const CLIENTS: u64 = 8;
const ROUNDS: u64 = 5;

// ------------------------------------------------------------ log counting

static WARNINGS: AtomicU64 = AtomicU64::new(0);
/// Sum of the `suppressed` counts of the summary lines.
static SUPPRESSED: AtomicU64 = AtomicU64::new(0);
static FIRST_LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

use accel_test_support::log_lines;

/// Counts the store's warnings (the launcher would print each of them).
fn count_warnings() -> log_lines::LineSubscriber {
    log_lines::LineSubscriber {
        wanted: |m| {
            *m.level() <= tracing::Level::WARN && m.target().starts_with("accel_rendezvous")
        },
        line: |l| {
            WARNINGS.fetch_add(1, Ordering::SeqCst);
            let suppressed = log_lines::u64_field(&l, "suppressed").unwrap_or(0);
            SUPPRESSED.fetch_add(suppressed, Ordering::SeqCst);
            let mut first = FIRST_LINES.lock().unwrap();
            if first.len() < 50 {
                first.push(l);
            }
        },
    }
}

// ------------------------------------------------------------ helpers

/// Raise the soft open-file limit towards `want` (up to the hard limit);
/// the limit in force afterwards.
fn raise_fd_limit(want: u64) -> u64 {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    if soft >= want {
        return soft;
    }
    let new = want.min(hard);
    if new <= soft {
        eprintln!("the open-file limit is {soft} (hard {hard}): sizing the test to it");
        return soft;
    }
    match setrlimit(Resource::RLIMIT_NOFILE, new, hard) {
        Ok(()) => {
            eprintln!("raised the open-file soft limit from {soft} to {new} (hard {hard})");
            new
        }
        Err(e) => {
            eprintln!("cannot raise the open-file limit from {soft}: {e}");
            soft
        }
    }
}

/// Threads of this process (Linux), to show that connections do not get one.
fn threads() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
}

/// One attacker: opens `n` connections of mixed kinds, keeps them open and
/// trickles bytes into some until `stop`.
fn attack(
    addr: SocketAddr,
    n: u64,
    seed: u64,
    stop: Arc<AtomicBool>,
    opened: Arc<AtomicU64>,
    done_opening: Arc<AtomicU64>,
) {
    let mut socks = Vec::new();
    for i in 0..n {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
            continue;
        };
        let _ = match (i + seed) % 4 {
            // Silent: connects and says nothing (half-open as far as the
            // store can tell).
            0 => Ok(()),
            // Half a frame header.
            1 => s.write_all(&[0x10, 0x00]),
            // A 60 kB hello announced, a few bytes sent, then a trickle.
            2 => {
                let mut b = 60_000u32.to_le_bytes().to_vec();
                b.extend_from_slice(&[1, b'A', b'C']);
                s.write_all(&b)
            }
            // A complete hello with a wrong token: refused (and logged).
            _ => {
                let mut hello = vec![0x01];
                hello.extend_from_slice(b"ACCELRDV");
                hello.extend_from_slice(&1u16.to_le_bytes());
                hello.push(1);
                hello.extend_from_slice(&5u32.to_le_bytes());
                hello.extend_from_slice(b"wrong");
                let mut f = (hello.len() as u32).to_le_bytes().to_vec();
                f.extend_from_slice(&hello);
                s.write_all(&f)
            }
        };
        opened.fetch_add(1, Ordering::SeqCst);
        socks.push(s);
    }
    done_opening.fetch_add(1, Ordering::SeqCst);
    // Keep them open, one byte into each now and then.
    while !stop.load(Ordering::SeqCst) {
        for s in socks.iter_mut().skip(2).step_by(4) {
            let _ = s.set_nonblocking(true);
            let _ = s.write(&[0x42]);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn thousands_of_slow_connections_do_not_lock_real_clients_out() {
    // Hard bound on the whole test.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(120));
        eprintln!("slow_clients: still running after 120 s, giving up");
        std::process::exit(2);
    });
    tracing::subscriber::set_global_default(count_warnings()).unwrap();

    // The attackers' ends plus the server's (at most max_handshakes of
    // those), plus room for the test itself.
    let limits = ServerLimits {
        handshake_timeout: Duration::from_secs(2),
        ..ServerLimits::default()
    };
    let reserve = limits.max_handshakes as u64 + 200;
    let fds = raise_fd_limit(FLOOD + reserve);
    let flood = FLOOD.min(fds.saturating_sub(reserve));
    eprintln!("open-file limit {fds}: flooding with {flood} connections");
    assert!(
        flood >= 500,
        "the open-file limit ({fds}) is too low for this test"
    );

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let server = TcpStoreServer::from_listener_with(listener, Some(TOKEN.into()), limits).unwrap();
    let addr = server.local_addr();
    let threads_before = threads();

    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicU64::new(0));
    let done_opening = Arc::new(AtomicU64::new(0));
    let attackers: Vec<_> = (0..ATTACKERS)
        .map(|a| {
            let (stop, opened, done) = (stop.clone(), opened.clone(), done_opening.clone());
            std::thread::spawn(move || attack(addr, flood / ATTACKERS, a, stop, opened, done))
        })
        .collect();
    // Real clients start once the flood is well under way.
    let start = Instant::now();
    while opened.load(Ordering::SeqCst) < flood / 3 && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            std::thread::spawn(move || -> Result<(), String> {
                for round in 0..ROUNDS {
                    let s = TcpStore::connect(addr, Some(TOKEN), Duration::from_secs(20))
                        .map_err(|e| format!("client {c} round {round}: connect: {e}"))?;
                    let key = format!("client/{c}/{round}");
                    s.set(&key, b"here").map_err(|e| e.to_string())?;
                    let got = s
                        .get(&key, Duration::from_secs(10))
                        .map_err(|e| e.to_string())?;
                    if got != b"here" {
                        return Err(format!("client {c}: read back {got:?}"));
                    }
                    s.add("done", 1).map_err(|e| e.to_string())?;
                }
                Ok(())
            })
        })
        .collect();
    let mut peak_threads = 0;
    let mut failures = Vec::new();
    for c in clients {
        peak_threads = peak_threads.max(threads().unwrap_or(0));
        if let Err(e) = c.join().unwrap() {
            failures.push(e);
        }
    }
    // Hold the flood until every attacker has opened its share and the
    // server has had to drop them at the deadline.
    while done_opening.load(Ordering::SeqCst) < ATTACKERS
        && start.elapsed() < Duration::from_secs(60)
    {
        peak_threads = peak_threads.max(threads().unwrap_or(0));
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(limits.handshake_timeout + Duration::from_millis(500));
    peak_threads = peak_threads.max(threads().unwrap_or(0));
    stop.store(true, Ordering::SeqCst);
    for a in attackers {
        a.join().unwrap();
    }
    let opened = opened.load(Ordering::SeqCst);
    let done = server.store().add("done", 0).unwrap();
    drop(server); // flushes the log summary

    assert!(failures.is_empty(), "real clients failed: {failures:#?}");
    assert_eq!(done, (CLIENTS * ROUNDS) as i64);
    assert!(
        opened >= flood / 2,
        "only {opened} of {flood} flood connections were opened"
    );
    // No thread per connection: the attackers, the clients, the harness,
    // the server's event loop and a thread per real client connection.
    if let (Some(before), true) = (threads_before, peak_threads > 0) {
        let bound = before + ATTACKERS + 3 * CLIENTS + 8;
        assert!(
            peak_threads <= bound,
            "{peak_threads} threads with {opened} connections open (before: {before})"
        );
    }
    // Every flood connection was refused or dropped, but the log holds a
    // few lines per 10 s window and counts the rest.
    let warnings = WARNINGS.load(Ordering::SeqCst);
    let suppressed = SUPPRESSED.load(Ordering::SeqCst);
    let windows = start.elapsed().as_secs() / 10 + 2;
    let lines = FIRST_LINES.lock().unwrap().clone();
    assert!(
        warnings <= windows * 6,
        "{warnings} warnings logged in {:?}: {lines:#?}",
        start.elapsed()
    );
    let reported = suppressed + warnings;
    assert!(
        reported >= opened * 9 / 10,
        "{opened} flood connections but only {reported} refusals reported: {lines:#?}"
    );
    eprintln!(
        "{opened} flood connections, {} real client sessions, {warnings} warnings \
         ({suppressed} more counted), peak {peak_threads} threads, {:?}",
        CLIENTS * ROUNDS,
        start.elapsed()
    );
}
