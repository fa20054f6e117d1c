//! Real processes: this test binary starts copies of itself as ranks
//! (`worker_process` does the work when ACCEL_GLOO_TEST_WORKER is set and
//! nothing otherwise), rendezvousing through a directory store, with Gloo
//! listening on the address ACCEL_GLOO_HOSTNAME names.

mod common;

use std::path::PathBuf;
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_api::{CommunicatorExt, ErrorKind, ReduceOp, Store};
use accel_rendezvous::FileStore;

const DEADLINE: Duration = Duration::from_secs(40);

fn store_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!("accel-gloo-{name}-{}-{nanos}", std::process::id()))
}

/// Wait for every child under the deadline; kill them all past it.
/// Returns (exit code, output) per rank.
fn wait_all(mut children: Vec<Child>) -> Vec<(Option<i32>, String)> {
    let end = Instant::now() + DEADLINE;
    let mut codes: Vec<Option<Option<i32>>> = vec![None; children.len()];
    while codes.iter().any(Option::is_none) {
        for (i, c) in children.iter_mut().enumerate() {
            if codes[i].is_none() {
                if let Ok(Some(st)) = c.try_wait() {
                    codes[i] = Some(st.code());
                }
            }
        }
        if Instant::now() > end {
            for c in &mut children {
                let _ = c.kill();
            }
            panic!("workers did not finish within {DEADLINE:?}: {codes:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    children
        .into_iter()
        .zip(codes)
        .map(|(c, code)| {
            let out = c.wait_with_output().expect("worker output");
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            (code.flatten(), text)
        })
        .collect()
}

/// Run `world` worker processes in `mode` over a fresh store directory
/// (removed afterwards); (exit code, output) per rank.
fn run_workers(mode: &str, world: usize) -> Vec<(Option<i32>, String)> {
    let dir = store_dir(mode);
    let children = (0..world)
        .map(|r| common::spawn_worker("worker_process", mode, r, world, &dir))
        .collect();
    let results = wait_all(children);
    let _ = std::fs::remove_dir_all(&dir);
    results
}

#[test]
fn three_processes_run_collectives() {
    let results = run_workers("ok", 3);
    for (rank, (code, out)) in results.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {rank} failed:\n{out}");
        assert!(out.contains("worker done"), "rank {rank}:\n{out}");
    }
}

#[test]
fn a_process_that_dies_is_named_by_the_others() {
    let results = run_workers("die", 3);
    assert_eq!(
        results[2].0,
        Some(17),
        "rank 2 should have died:\n{}",
        results[2].1
    );
    for (rank, (code, out)) in results.iter().enumerate().take(2) {
        assert_eq!(*code, Some(0), "rank {rank} failed:\n{out}");
        assert!(out.contains("saw peer 2 lost"), "rank {rank}:\n{out}");
    }
}

/// The rank side of the tests above; a no-op in a normal test run.
#[test]
fn worker_process() {
    let Ok(mode) = std::env::var("ACCEL_GLOO_TEST_WORKER") else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    let rank: usize = var("RANK").parse().unwrap();
    let world: usize = var("WORLD_SIZE").parse().unwrap();
    let store: Arc<dyn Store> = Arc::new(FileStore::new(var("ACCEL_GLOO_TEST_STORE")).unwrap());
    let c = common::connect(store, rank, world, Duration::from_secs(5)).unwrap();
    let sum = c.all_reduce_vec(&[rank as i64, 1], ReduceOp::Sum).unwrap();
    assert_eq!(sum, vec![(world * (world - 1) / 2) as i64, world as i64]);
    match mode.as_str() {
        "ok" => {
            let all = c.all_gather_vec(&[rank as f32]).unwrap();
            assert_eq!(all, (0..world).map(|r| r as f32).collect::<Vec<_>>());
            let mut b = [rank as u8; 4];
            c.broadcast_slice(&mut b, world - 1).unwrap();
            assert_eq!(b, [(world - 1) as u8; 4]);
            let sub = c.split(Some((rank % 2) as u32), 0).unwrap().unwrap();
            let s = sub.all_reduce_vec(&[1i32], ReduceOp::Sum).unwrap();
            assert_eq!(s[0] as usize, sub.world_size());
            c.barrier().unwrap();
        }
        "die" => {
            if rank == 2 {
                // Die without any cleanup: the kernel closes the sockets.
                std::process::exit(17);
            }
            let e = c.all_reduce_vec(&[1i32], ReduceOp::Sum).unwrap_err();
            assert_eq!(e.kind(), &ErrorKind::PeerLost { peer: Some(2) }, "{e}");
            println!("saw peer 2 lost: {e}");
            assert_eq!(c.barrier().unwrap_err().kind(), &ErrorKind::Poisoned);
        }
        other => panic!("unknown worker mode {other}"),
    }
    println!("worker done");
}
