//! Round-trip latency of one store: `set` then `get` of the same key, N
//! times, after a warm-up; prints the median and the best in microseconds.
//! `tcp` hosts accel's TCP store on loopback here; any other argument is a
//! store URL (`etcd://127.0.0.1:2379/bench`). scripts/bench_rendezvous.sh
//! runs it against both, interleaved.
//!
//! cargo run --release -p accel-rendezvous --features etcd --example store_latency -- tcp 2000

use std::time::{Duration, Instant};

use accel_api::Store;
use accel_rendezvous::{open_store, TcpStoreServer};

fn main() -> accel_api::Result<()> {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or_else(|| "tcp".into());
    let n: usize = args.next().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let t = Duration::from_secs(10);
    let server;
    let store = if url == "tcp" {
        server = TcpStoreServer::bind_loopback(0, Some("bench".into()))?;
        open_store(&server.url(), Some("bench"), t)?
    } else {
        open_store(&url, None, t)?
    };
    let mut took = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        let v = i.to_le_bytes();
        let start = Instant::now();
        store.set("latency", &v)?;
        let got = store.get("latency", t)?;
        let d = start.elapsed();
        assert_eq!(got, v, "the store returned another value");
        if i >= n / 10 {
            took.push(d);
        }
    }
    took.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "{}: set+get median {:.0} us, best {:.0} us ({n} round trips)",
        store.describe(),
        us(took[took.len() / 2]),
        us(took[0])
    );
    Ok(())
}
