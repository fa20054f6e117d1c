//! A peer killed with SIGKILL, bare (no launcher to stop the others): every
//! survivor gets `PeerLost` naming the dead rank well before its timeout,
//! whatever it was doing when the peer died (large and small collectives,
//! point-to-point sends and receives). Gloo leaves a send whose bytes were
//! queued on the dead connection waiting for its timeout; the shim's
//! guarded buffers notice the failed connection instead (issue 32, item 5).
//!
//! Each trial starts `world` copies of this test binary as ranks
//! (`dead_peer_worker` does the work when ACCEL_GLOO_TEST_WORKER is set),
//! waits until the victim has run a few rounds, kills it, and checks every
//! survivor's report.

use accel_test_support::child;
mod common;

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use accel_api::{CommunicatorExt, ErrorKind, ReduceOp, Store};
use accel_rendezvous::FileStore;

/// The survivors' timeout: far above the bound, so that a survivor that
/// waits it out fails the test.
const TIMEOUT: Duration = Duration::from_secs(20);
/// How long after the kill a survivor may take to report the loss (the
/// issue asks 1 s; the rest is slack for a loaded two-core machine).
const BOUND: Duration = Duration::from_millis(2000);
/// Hard bound on one trial.
const TRIAL_DEADLINE: Duration = Duration::from_secs(40);

fn micros_now() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or(0)
}

fn spawn(rank: usize, world: usize, dir: &Path) -> Child {
    common::spawn_worker("dead_peer_worker", "1", rank, world, dir)
}

fn kill_all(children: &mut [Option<Child>]) {
    for c in children.iter_mut().flatten() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Kill every rank and say what each printed (the end of it): why a trial
/// that did not get going did not.
fn kill_and_tell(children: &mut [Option<Child>]) -> String {
    let mut told = Vec::new();
    for (rank, slot) in children.iter_mut().enumerate() {
        let Some(mut c) = slot.take() else { continue };
        let _ = c.kill();
        let text = c.wait_with_output().map_or_else(
            |e| format!("(no output: {e})"),
            |out| {
                let all = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                let lines: Vec<&str> = all.lines().collect();
                lines[lines.len().saturating_sub(15)..].join("\n")
            },
        );
        told.push(format!("rank {rank} printed:\n{text}"));
    }
    told.join("\n")
}

/// One trial: `world` ranks, `victim` killed `delay` after its first
/// rounds. Returns the slowest survivor's report latency, or why the
/// trial failed.
fn trial(world: usize, victim: usize, delay: Duration, n: usize) -> Result<Duration, String> {
    let dir: PathBuf = std::env::temp_dir().join(format!(
        "accel-gloo-dead-{}-{n}-{}",
        std::process::id(),
        micros_now()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut children: Vec<Option<Child>> =
        (0..world).map(|r| Some(spawn(r, world, &dir))).collect();
    let start = Instant::now();
    let ready = dir.join(format!("ready-{victim}"));
    while !ready.exists() {
        if start.elapsed() > TRIAL_DEADLINE {
            let told = kill_and_tell(&mut children);
            return Err(format!(
                "the ranks did not start their rounds within {TRIAL_DEADLINE:?}\n{told}"
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(delay);
    let killed_at = micros_now();
    let mut v = children[victim].take().expect("victim");
    let killed = v.kill();
    let _ = v.wait();
    if let Err(e) = killed {
        kill_all(&mut children);
        return Err(format!("could not kill rank {victim}: {e}"));
    }
    let mut worst = Duration::ZERO;
    let mut problems = Vec::new();
    for (rank, slot) in children.iter_mut().enumerate() {
        let Some(mut c) = slot.take() else { continue };
        let code = child::wait_within(&mut c, TRIAL_DEADLINE).and_then(|st| st.code());
        let out = c.wait_with_output().map_err(|e| e.to_string())?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let line = text.lines().find_map(|l| l.find("LOST ").map(|i| &l[i..]));
        let Some(line) = line else {
            problems.push(format!(
                "rank {rank} (exit {code:?}) reported no loss:\n{text}"
            ));
            continue;
        };
        // LOST <micros> <peer> <message>
        let mut words = line.splitn(4, ' ');
        let _ = words.next();
        let at: u128 = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
        let peer = words.next().unwrap_or("?");
        let latency = Duration::from_micros(at.saturating_sub(killed_at) as u64);
        worst = worst.max(latency);
        if peer != victim.to_string() || code != Some(0) {
            problems.push(format!(
                "rank {rank} (exit {code:?}) did not name rank {victim}: {line}"
            ));
        } else if latency > BOUND {
            problems.push(format!(
                "rank {rank} reported the loss {latency:?} after the kill (bound {BOUND:?}): {line}"
            ));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    if problems.is_empty() {
        Ok(worst)
    } else {
        Err(problems.join("\n"))
    }
}

fn trials(world: usize, count: usize) {
    let mut failures = Vec::new();
    let mut worst = Duration::ZERO;
    for n in 0..count {
        let victim = (n * 7 + 1) % world;
        // Spread the kill over the rounds' phases.
        let delay = Duration::from_millis(((n * 37) % 150) as u64);
        match trial(world, victim, delay, n) {
            Ok(w) => worst = worst.max(w),
            Err(e) => failures.push(format!("trial {n} (victim {victim}, delay {delay:?}): {e}")),
        }
    }
    eprintln!(
        "{world} ranks: {}/{count} trials held, slowest report {worst:?} after the kill",
        count - failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn a_killed_peer_is_named_by_every_survivor_at_two_ranks() {
    trials(2, 26);
}

#[test]
fn a_killed_peer_is_named_by_every_survivor_at_four_ranks() {
    trials(4, 24);
}

/// The rank side: rounds of collectives and point-to-point messages of
/// several sizes until one fails; a no-op in a normal test run.
#[test]
fn dead_peer_worker() {
    if std::env::var_os("ACCEL_GLOO_TEST_WORKER").is_none() {
        return;
    }
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    let rank: usize = var("RANK").parse().unwrap();
    let world: usize = var("WORLD_SIZE").parse().unwrap();
    let dir = PathBuf::from(var("ACCEL_GLOO_TEST_STORE"));
    let store: Arc<dyn Store> = Arc::new(FileStore::new(&dir).unwrap());
    let c = common::connect(store, rank, world, TIMEOUT).unwrap();
    let big = vec![1.0f32; 1 << 20];
    let mid = vec![rank as u8; 300 << 10];
    let partner = rank ^ 1;
    let mut round = 0u64;
    let err = loop {
        let step = (|| -> accel_api::Result<()> {
            c.all_reduce_vec(&[1i32], ReduceOp::Sum)?;
            c.all_reduce_vec(&big, ReduceOp::Sum)?;
            let mut b = mid.clone();
            c.broadcast_slice(&mut b, (round as usize) % world)?;
            c.all_gather_vec(&big[..4096])?;
            if partner < world {
                let mut got = vec![0u8; mid.len()];
                if rank.is_multiple_of(2) {
                    c.send_slice(&mid, partner, 1)?;
                    c.recv_slice(&mut got, partner, 2)?;
                } else {
                    c.recv_slice(&mut got, partner, 1)?;
                    c.send_slice(&mid, partner, 2)?;
                }
            }
            c.barrier()
        })();
        if let Err(e) = step {
            break e;
        }
        round += 1;
        if round == 2 {
            let _ = std::fs::write(dir.join(format!("ready-{rank}")), b"");
        }
    };
    let at = micros_now();
    let peer = match err.kind() {
        ErrorKind::PeerLost { peer: Some(p) } => p.to_string(),
        _ => "-".to_string(),
    };
    println!("LOST {at} {peer} after {round} rounds: {err}");
    if peer == "-" {
        std::process::exit(3);
    }
}
