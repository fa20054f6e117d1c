//! Threads as ranks: every rank is a thread connecting through one shared
//! in-memory store; every test runs under a hard deadline so that a hung
//! collective fails the test instead of hanging the suite.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_api::{Backend, Communicator, ConnectContext, Result, Store};
use accel_backend_cpu_gloo::BACKEND;
use accel_rendezvous::MemoryStore;

pub fn context(
    store: Arc<dyn Store>,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> ConnectContext {
    ConnectContext::local(rank, world, timeout, store).with_run_id("test")
}

pub fn connect(
    store: Arc<dyn Store>,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> Result<Box<dyn Communicator>> {
    BACKEND.connect(context(store, rank, world, timeout))
}

/// Run `f(rank, communicator)` on `world` threads connected through a fresh
/// store, and return the results in rank order. Panics (failing the test)
/// when a rank panics or when the whole thing takes longer than `deadline`.
pub fn run_ranks<T, F>(world: usize, timeout: Duration, deadline: Duration, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize, Box<dyn Communicator>) -> T + Send + Sync + 'static,
{
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let f = Arc::new(f);
    spawn_ranks(world, deadline, move |rank| {
        let comm = connect(store.clone(), rank, world, timeout)
            .unwrap_or_else(|e| panic!("rank {rank} could not connect: {e}"));
        f(rank, comm)
    })
}

/// Run `f(rank)` on `world` threads under a deadline; results in rank order.
pub fn spawn_ranks<T, F>(world: usize, deadline: Duration, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize) -> T + Send + Sync + 'static,
{
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for rank in 0..world {
        let tx = tx.clone();
        let f = f.clone();
        std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(rank)));
                let _ = tx.send((rank, r));
            })
            .expect("spawn rank thread");
    }
    drop(tx);
    let end = Instant::now() + deadline;
    let mut out: Vec<Option<T>> = (0..world).map(|_| None).collect();
    for _ in 0..world {
        let left = end.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, Ok(v))) => out[rank] = Some(v),
            Ok((rank, Err(p))) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("rank {rank} panicked: {msg}");
            }
            Err(_) => {
                let missing: Vec<usize> = (0..world).filter(|r| out[*r].is_none()).collect();
                panic!("ranks {missing:?} did not finish within {deadline:?}");
            }
        }
    }
    out.into_iter()
        .map(|v| v.expect("every rank reported"))
        .collect()
}

/// The error of `r`, which must have failed (`T` need not be `Debug`).
pub fn must_fail<T>(r: Result<T>, what: &str) -> accel_api::Error {
    match r {
        Ok(_) => panic!("{what} should have failed"),
        Err(e) => e,
    }
}

/// Start a copy of this test binary running only `test` as rank `rank` of
/// `world` in worker `mode` (ACCEL_GLOO_TEST_WORKER), rendezvousing through
/// the directory store `dir` on loopback; output piped.
pub fn spawn_worker(test: &str, mode: &str, rank: usize, world: usize, dir: &Path) -> Child {
    Command::new(std::env::current_exe().expect("test binary path"))
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env("ACCEL_GLOO_TEST_WORKER", mode)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("ACCEL_GLOO_TEST_STORE", dir)
        .env("ACCEL_GLOO_HOSTNAME", "127.0.0.1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start a worker")
}
