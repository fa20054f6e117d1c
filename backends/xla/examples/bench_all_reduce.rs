//! all_reduce latency and bandwidth on N rank threads of the xla backend,
//! with the method of `accel bench` (docs/benchmarks.md): per size, warm-up
//! calls, then ITERS times { barrier; time one all_reduce (f32, sum,
//! zero-filled, in place) }; an iteration's time is the slowest rank's; the
//! reported time is the median over iterations. busbw uses nccl-tests'
//! all-reduce factor 2(n-1)/n.
//!
//! ```sh
//! N=2 SIZES=4K:64M ITERS=20 WARMUP=3 \
//!   cargo run --release -p accel-backend-xla --example bench_all_reduce
//! ```
//! `--json` prints one JSON object per size instead of the table.

use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_api::{Communicator, CommunicatorExt, ConnectContext, Device, ReduceOp, Store};
use accel_rendezvous::MemoryStore;

fn env_usize(k: &str, default: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn parse_size(s: &str) -> usize {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K') => (&s[..s.len() - 1], 1 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().expect("a size like 4K, 1M or 4096") * mult
}

/// `LO:HI` doubles from LO to HI; a single size is itself.
fn sizes(spec: &str) -> Vec<usize> {
    match spec.split_once(':') {
        Some((lo, hi)) => {
            let (mut s, hi) = (parse_size(lo), parse_size(hi));
            let mut v = Vec::new();
            while s <= hi {
                v.push(s);
                s *= 2;
            }
            v
        }
        None => vec![parse_size(spec)],
    }
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

fn main() {
    let n = env_usize("N", 2);
    let iters = env_usize("ITERS", 20);
    let warmup = env_usize("WARMUP", 3);
    let sizes = sizes(&std::env::var("SIZES").unwrap_or_else(|_| "4K:64M".into()));
    let json = std::env::args().any(|a| a == "--json");
    let plugin = match accel_backend_xla::describe_plugin() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("bench_all_reduce: {e}");
            std::process::exit(2);
        }
    };
    let store = Arc::new(MemoryStore::new());
    // times[rank][size][iter]
    let times: Vec<Vec<Vec<Duration>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let store = store.clone();
                let sizes = &sizes;
                s.spawn(move || {
                    let c = accel_backend_xla::__test::connect(ConnectContext {
                        rank,
                        world_size: n,
                        local_rank: rank,
                        local_world_size: n,
                        device: Device::CPU,
                        timeout: Duration::from_secs(300),
                        store: store as Arc<dyn Store>,
                        run_id: "bench".into(),
                    })
                    .expect("connect");
                    sizes
                        .iter()
                        .map(|&bytes| {
                            let mut buf = vec![0f32; bytes / 4];
                            for _ in 0..warmup {
                                c.all_reduce_slice(&mut buf, ReduceOp::Sum).unwrap();
                            }
                            (0..iters)
                                .map(|_| {
                                    c.barrier().unwrap();
                                    let t = Instant::now();
                                    c.all_reduce_slice(&mut buf, ReduceOp::Sum).unwrap();
                                    t.elapsed()
                                })
                                .collect()
                        })
                        .collect()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    if !json {
        println!("# xla all_reduce, {n} rank threads, f32 sum, {iters} iterations, median of the slowest rank");
        println!("# {plugin}");
        println!("| size | time (µs) | best (µs) | algbw (GB/s) | busbw (GB/s) |");
        println!("|---:|---:|---:|---:|---:|");
    }
    for (si, &bytes) in sizes.iter().enumerate() {
        let mut per_iter: Vec<Duration> = (0..iters)
            .map(|i| times.iter().map(|r| r[si][i]).max().unwrap_or_default())
            .collect();
        per_iter.sort();
        let median = per_iter[per_iter.len() / 2].as_secs_f64();
        let best = per_iter[0].as_secs_f64();
        let algbw = bytes as f64 / median / 1e9;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        if json {
            println!(
                "{{\"backend\":\"xla\",\"n\":{n},\"bytes\":{bytes},\"median_us\":{:.1},\"best_us\":{:.1},\"algbw_gbs\":{algbw:.3},\"busbw_gbs\":{busbw:.3}}}",
                median * 1e6,
                best * 1e6
            );
        } else {
            println!(
                "| {} | {:.1} | {:.1} | {algbw:.3} | {busbw:.3} |",
                human(bytes),
                median * 1e6,
                best * 1e6
            );
        }
    }
}
