//! Background saves killed at random moments: the demo saves every step
//! with `save_state_async` and is SIGKILLed 20 times at random moments,
//! each run resuming the last; after every kill the newest checkpoint is
//! complete (its manifest and every file check), and a last run resumes
//! from it and finishes.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A small xorshift: reproducible kill moments.
fn next(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

fn train(ckpt: &std::path::Path, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_train"));
    c.args([
        "--epochs",
        "1000",
        "--train-len",
        "2000",
        "--hidden",
        "64",
        "--save-every",
        "1",
        "--keep",
        "3",
        "--async-save",
        "--resume",
        "--checkpoint-dir",
    ])
    .arg(ckpt)
    .args(extra)
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    c
}

#[test]
fn async_saves_killed_at_random_moments_leave_the_newest_checkpoint_complete() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ck");
    let mut seed = 0x5eed_u64;
    let mut newest = Vec::new();
    for round in 0..20 {
        let mut child = train(&ckpt, &[]).spawn().unwrap();
        let wait = Duration::from_millis(150 + next(&mut seed) % 500);
        std::thread::sleep(wait);
        let _ = child.kill(); // SIGKILL
        let _ = child.wait();
        let latest = accel_sharding::CheckpointDir::new(&ckpt, None)
            .latest()
            .unwrap();
        if let Some((n, dir)) = latest {
            accel_sharding::verify_checkpoint(&dir)
                .unwrap_or_else(|e| panic!("round {round}: checkpoint_{n} after a kill: {e}"));
            newest.push(n);
        }
    }
    assert!(
        newest.len() >= 15 && newest.windows(2).all(|w| w[0] <= w[1]),
        "checkpoints saved and kept going forward: {newest:?}"
    );
    // The newest loads: a run resumes from it and stops one step later.
    let last = *newest.last().unwrap();
    let start = Instant::now();
    let out = train(&ckpt, &["--stop-after", &(last + 2).to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "resuming after the kills: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(start.elapsed() < Duration::from_secs(60));
}
