//! The budget of accel's bounded fuzz harnesses (each crate's
//! `tests/fuzz_*.rs`).
//!
//! A harness is a proptest strategy (arbitrary bytes and structure-aware
//! mutations of valid inputs) and a property. By default it runs a fixed
//! number of cases from a seed derived from its name, so that `cargo test`
//! is deterministic and takes a few seconds. With `ACCEL_FUZZ_SECONDS=N` it
//! keeps running batches of that size, each from the next seed, for N
//! seconds, and prints how many cases it executed: the long run recorded in
//! docs/fuzzing.md.
//!
//! A failure panics with proptest's minimal failing input and the number of
//! its batch, so that it can be replayed; `ACCEL_FUZZ_FIRST_BATCH=N` starts
//! a run at batch N.

use std::time::{Duration, Instant};

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

/// What one harness did.
#[derive(Debug, Clone, Copy)]
pub struct Ran {
    /// Cases executed (every batch together).
    pub cases: u64,
    /// Batches (seeds) run.
    pub batches: u64,
}

/// The long-run budget from `ACCEL_FUZZ_SECONDS`, if set.
fn long_run() -> Option<Duration> {
    let v = std::env::var("ACCEL_FUZZ_SECONDS").ok()?;
    match v.trim().parse::<u64>() {
        Ok(s) => Some(Duration::from_secs(s)),
        Err(_) => panic!("ACCEL_FUZZ_SECONDS={v:?} is not a number of seconds"),
    }
}

/// The first batch, from `ACCEL_FUZZ_FIRST_BATCH` (0 by default): resume a
/// long run past a batch that failed.
fn first_batch() -> u64 {
    match std::env::var("ACCEL_FUZZ_FIRST_BATCH") {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("ACCEL_FUZZ_FIRST_BATCH={v:?} is not a number")),
        Err(_) => 0,
    }
}

/// FNV-1a: a stable seed from the harness name and the batch number.
fn seed(name: &str, batch: u64) -> [u8; 32] {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes().chain(batch.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let mut out = [0u8; 32];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let x = h.rotate_left(i as u32 * 17) ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    out
}

/// Run `property` on `cases` inputs drawn from `strategy` (or batches of
/// them for `ACCEL_FUZZ_SECONDS`), panicking with the minimal failing input.
pub fn fuzz<S>(
    name: &str,
    cases: u32,
    strategy: S,
    property: impl Fn(S::Value) -> Result<(), TestCaseError>,
) -> Ran
where
    S: Strategy,
    S::Value: std::fmt::Debug,
{
    let budget = long_run();
    let start = Instant::now();
    let first = first_batch();
    let mut ran = Ran {
        cases: 0,
        batches: 0,
    };
    loop {
        let batch = first + ran.batches;
        let batch_seed = seed(name, batch);
        let config = Config {
            cases,
            failure_persistence: None,
            // Shrinking a failure is bounded too.
            max_shrink_time: 60_000,
            ..Config::default()
        };
        let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &batch_seed);
        let mut runner = TestRunner::new_with_rng(config, rng);
        match runner.run(&strategy, &property) {
            Ok(()) => {}
            Err(TestError::Fail(why, input)) => panic!(
                "fuzz {name}: batch {batch} (after {} passing cases) failed: {why}\nminimal input: {input:#?}",
                ran.cases
            ),
            Err(TestError::Abort(why)) => panic!("fuzz {name}: aborted: {why}"),
        }
        ran.cases += u64::from(cases);
        ran.batches += 1;
        match budget {
            Some(b) if start.elapsed() < b => {}
            _ => break,
        }
    }
    println!(
        "fuzz {name}: {} cases in {} batch(es) from batch {first}, {:.1?}, no failure",
        ran.cases,
        ran.batches,
        start.elapsed()
    );
    ran
}
