//! A minimal cpu-gloo rank for trying the backend across processes by hand
//! (or from a launcher) before the TCP store exists:
//!
//! ```text
//! for r in 0 1 2; do
//!   RANK=$r WORLD_SIZE=3 ACCEL_GLOO_STORE_DIR=/tmp/gloo-run ACCEL_GLOO_HOSTNAME=127.0.0.1 \
//!     cargo run -q -p accel-backend-cpu-gloo --example gloo_worker &
//! done; wait
//! ```
//!
//! It connects through a directory store (accel-rendezvous's `FileStore`;
//! the directory must be fresh for each run), runs a few collectives,
//! checks them and prints one line. ACCEL_TIMEOUT_SECS sets the timeout
//! (default 30).

use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_api::{Backend, CommunicatorExt, ConnectContext, ReduceOp, Result, Store};
use accel_backend_cpu_gloo::BACKEND;
use accel_rendezvous::FileStore;

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        eprintln!("gloo_worker: set {name} (see the example's docs)");
        std::process::exit(2)
    })
}

fn main() -> Result<()> {
    let rank: usize = var("RANK").parse().expect("RANK is a number");
    let world: usize = var("WORLD_SIZE").parse().expect("WORLD_SIZE is a number");
    let timeout = Duration::from_secs(
        std::env::var("ACCEL_TIMEOUT_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(30),
    );
    let store: Arc<dyn Store> = Arc::new(FileStore::new(var("ACCEL_GLOO_STORE_DIR"))?);
    let start = Instant::now();
    let c = BACKEND
        .connect(ConnectContext::local(rank, world, timeout, store).with_run_id("gloo-worker"))?;
    let connected = start.elapsed();
    let sum = c.all_reduce_vec(&[rank as f64 + 1.0], ReduceOp::Sum)?;
    let want = (world * (world + 1) / 2) as f64;
    assert_eq!(sum, vec![want], "all_reduce");
    let ranks = c.all_gather_vec(&[rank as i32])?;
    assert_eq!(ranks, (0..world as i32).collect::<Vec<_>>(), "all_gather");
    c.barrier()?;
    println!(
        "rank {rank}/{world}: connected in {connected:?}, all_reduce and all_gather correct ({})",
        accel_backend_cpu_gloo::__test::engine_version()
    );
    Ok(())
}
