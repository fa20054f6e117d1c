//! The burn digits demo as separate processes on 2 ranks over cpu-gloo
//! (every one under a hard timeout): it reaches 95 % held-out accuracy in
//! 10 epochs, every held-out image counted once; a run stopped 3 optimizer
//! steps after a checkpoint (mid-epoch, mid-accumulation) and resumed ends
//! with the parameter checksum of an uninterrupted run.
//!
//! Ranks are started directly with torchrun-style variables and a file
//! store, so the tests need no launcher binary (`make demo-burn` runs the
//! demo through `accel launch`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use accel_example_burn_digits::Digits;
use accel_test_support::demo_ranks;
use demo_ranks::{accuracy_in, checksum_of, final_line};

const LIMIT: Duration = Duration::from_secs(240);

fn data() -> PathBuf {
    demo_ranks::digits_data(Digits::default_path())
}

/// Run the demo on 2 ranks over cpu-gloo; rank 0's stdout.
fn run(store: &Path, args: &[String]) -> String {
    let exe = env!("CARGO_BIN_EXE_burn-digits");
    demo_ranks::run_ranks(exe, 2, "cpu-gloo", store, args, LIMIT, |cmd| {
        // One rayon thread per rank on a small machine.
        cmd.env("RAYON_NUM_THREADS", "1");
    })
}

/// The held-out accuracy (percent) on rank 0's final line, which must
/// count all 360 held-out images.
fn accuracy_of(out: &str) -> f64 {
    let last = final_line(out);
    assert!(last.contains("over 360 held-out images"), "{last}");
    accuracy_in(last)
}

#[test]
fn stopped_and_resumed_run_ends_bit_identical() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (full, stopped, resumed) =
        demo_ranks::stop_and_resume(dir.path(), &data(), run, |_, _| Vec::new());
    assert_ne!(checksum_of(&stopped), checksum_of(&full));
    assert!(resumed.contains("at step 8"), "{resumed}");
}

#[test]
fn two_ranks_reach_95_percent_held_out_in_10_epochs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let list = ["--epochs", "10", "--save-every", "0"];
    let mut a = demo_ranks::demo_args(&list, &data(), &dir.path().join("ck"));
    a.push("--save-model".into());
    a.push(dir.path().join("weights").display().to_string());
    let out = run(&dir.path().join("store"), &a);
    let acc = accuracy_of(&out);
    assert!(acc >= 95.0, "accuracy {acc}% after 10 epochs:\n{out}");
    assert!(dir.path().join("weights/model.safetensors").is_file());
}
