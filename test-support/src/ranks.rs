//! Rank threads for tests: a world of `accel::Threads` under a hard
//! bound (feature `ranks`: `accel` with cpu-gloo).

use std::sync::mpsc;
use std::time::Duration;

use accel::Accelerator;

/// Run `f` on 2 rank threads over cpu-gloo, under a hard bound.
pub fn two_ranks<T: Send + 'static>(
    f: impl Fn(&Accelerator) -> accel::Result<T> + Send + Sync + 'static,
) -> Vec<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let out = accel::Threads::new(2)
            .backend("cpu-gloo")
            .timeout(Duration::from_secs(30))
            .run(f);
        let _ = tx.send(out);
    });
    rx.recv_timeout(Duration::from_secs(120))
        .expect("the 2 ranks finished within 120 s")
        .unwrap_or_else(|e| panic!("{e}"))
}
