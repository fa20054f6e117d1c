//! The candle digits demo as separate processes on 2 ranks over cpu-gloo
//! (every one under a hard timeout): it reaches 95 % held-out accuracy in
//! 10 epochs, every held-out image counted once; a run stopped 3 optimizer
//! steps after a checkpoint (mid-epoch, mid-accumulation) and resumed ends
//! with the parameter checksum of an uninterrupted run.
//!
//! Ranks are started directly with torchrun-style variables and a file
//! store, so the tests need no launcher binary (`make demo-candle` runs the
//! demo through `accel launch`).

use accel_example_candle_digits::Digits;
use accel_test_support::demo_ranks;

accel_test_support::digits_demo_tests!(
    exe = env!("CARGO_BIN_EXE_candle-digits"),
    data = Digits::default_path(),
);

/// Four epochs with bf16 compute and gradient clipping.
const BF16_4_EPOCHS: [&str; 8] = [
    "--epochs",
    "4",
    "--save-every",
    "0",
    "--mixed-precision",
    "bf16",
    "--max-grad-norm",
    "5",
];

#[test]
fn two_ranks_learn_the_digits_with_bf16_compute_copies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let list = BF16_4_EPOCHS;
    let a = demo_ranks::demo_args(&list, &data(), &dir.path().join("ck"));
    let out = run(&dir.path().join("store"), &a);
    assert!(
        out.contains("mixed precision bf16 (forward in BF16)"),
        "{out}"
    );
    let acc = accuracy_of(&out);
    assert!(acc > 90.0, "accuracy {acc}% after 4 bf16 epochs:\n{out}");
}

/// `--plain` (the benchmark's twin without accel) trains the same model in
/// one process: every optimizer step of 2 epochs (1,437 images, batch 16,
/// 2 accumulation steps: 45 per epoch), ending below chance's loss.
#[test]
fn the_plain_candle_twin_trains_the_same_steps() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_candle-digits"))
        .args([
            "--plain",
            "--epochs",
            "2",
            "--no-eval",
            "--save-every",
            "0",
            "--data",
        ])
        .arg(data())
        .output()
        .expect("candle-digits");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("plain candle: 90 steps, loss "), "{text}");
    let loss: f64 = text
        .split("loss ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .and_then(|l| l.parse().ok())
        .unwrap_or_else(|| panic!("no loss in {text}"));
    assert!(loss < 10f64.ln(), "loss {loss} after 2 epochs: {text}");
}
