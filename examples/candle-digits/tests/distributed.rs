//! The candle digits demo as separate processes on 2 ranks over cpu-gloo
//! (every one under a hard timeout): it reaches 95 % held-out accuracy in
//! 10 epochs, every held-out image counted once; a run stopped 3 optimizer
//! steps after a checkpoint (mid-epoch, mid-accumulation) and resumed ends
//! with the parameter checksum of an uninterrupted run.
//!
//! Ranks are started directly with torchrun-style variables and a file
//! store, so the tests need no launcher binary (`make demo-candle` runs the
//! demo through `accel launch`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(240);

fn data() -> PathBuf {
    let p = accel_example_candle_digits::Digits::default_path();
    assert!(
        p.exists(),
        "{} is missing: run scripts/digits_data.sh (or make tch-setup) first",
        p.display()
    );
    p
}

/// Wait for `child` at most until `deadline`; kill it after.
fn wait_bounded(mut child: Child, deadline: Instant) -> Output {
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "a rank ran past {LIMIT:?}; stdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Run the demo on 2 ranks over cpu-gloo; rank 0's stdout.
fn run(store: &Path, args: &[String]) -> String {
    std::fs::create_dir_all(store).expect("store dir");
    let children: Vec<Child> = (0..2)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_candle-digits"))
                .args(args)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_WORLD_SIZE", "2")
                .env("ACCEL_BACKEND", "cpu-gloo")
                .env("ACCEL_STORE_URL", format!("file://{}", store.display()))
                .env(
                    "ACCEL_RUN_ID",
                    store.file_name().unwrap().to_string_lossy().to_string(),
                )
                .env("ACCEL_TIMEOUT", "60")
                // One candle (rayon) thread per rank on a small machine.
                .env("RAYON_NUM_THREADS", "1")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("starting candle-digits")
        })
        .collect();
    let deadline = Instant::now() + LIMIT;
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| wait_bounded(c, deadline))
        .collect();
    for (rank, o) in outs.iter().enumerate() {
        assert!(
            o.status.success(),
            "rank {rank} failed ({}):\nstdout:\n{}\nstderr:\n{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    String::from_utf8_lossy(&outs[0].stdout).into_owned()
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn checksum_of(stdout: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.split("params checksum ").nth(1))
        .unwrap_or_else(|| panic!("no checksum in:\n{stdout}"))
        .trim()
        .to_string()
}

/// The held-out accuracy (percent) on rank 0's final line, which must
/// count all 360 held-out images.
fn accuracy_of(out: &str) -> f64 {
    let last = out
        .lines()
        .find(|l| l.starts_with("final:"))
        .unwrap_or_else(|| panic!("no final line:\n{out}"));
    assert!(last.contains("over 360 held-out images"), "{last}");
    last.split("accuracy ")
        .nth(1)
        .and_then(|s| s.split('%').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {last}"))
}

#[test]
fn stopped_and_resumed_run_ends_bit_identical() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = data();
    let base = |ck: &str| {
        let mut a = args(&[
            "--train-len",
            "400",
            "--epochs",
            "2",
            "--save-every",
            "4",
            "--keep",
            "2",
            "--data",
        ]);
        a.push(data.display().to_string());
        a.push("--checkpoint-dir".into());
        a.push(dir.path().join(ck).display().to_string());
        a
    };
    let full = run(&dir.path().join("s1"), &base("full"));
    let mut stop = base("cut");
    stop.extend(args(&["--stop-after", "11"]));
    let stopped = run(&dir.path().join("s2"), &stop);
    assert!(stopped.contains("stopped at step 11"), "{stopped}");
    assert_ne!(checksum_of(&stopped), checksum_of(&full));
    let mut resume = base("cut");
    resume.push("--resume".into());
    let resumed = run(&dir.path().join("s3"), &resume);
    assert!(resumed.contains("resumed from"), "{resumed}");
    assert!(resumed.contains("at step 8"), "{resumed}");
    assert_eq!(
        checksum_of(&full),
        checksum_of(&resumed),
        "full:\n{full}\nresumed:\n{resumed}"
    );
}

#[test]
fn two_ranks_reach_95_percent_held_out_in_10_epochs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut a = args(&["--epochs", "10", "--save-every", "0", "--data"]);
    a.push(data().display().to_string());
    a.push("--checkpoint-dir".into());
    a.push(dir.path().join("ck").display().to_string());
    a.push("--save-model".into());
    a.push(dir.path().join("weights").display().to_string());
    let out = run(&dir.path().join("store"), &a);
    let acc = accuracy_of(&out);
    assert!(acc >= 95.0, "accuracy {acc}% after 10 epochs:\n{out}");
    assert!(dir.path().join("weights/model.safetensors").is_file());
}

#[test]
fn two_ranks_learn_the_digits_with_bf16_compute_copies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut a = args(&[
        "--epochs",
        "4",
        "--save-every",
        "0",
        "--mixed-precision",
        "bf16",
        "--max-grad-norm",
        "5",
        "--data",
    ]);
    a.push(data().display().to_string());
    a.push("--checkpoint-dir".into());
    a.push(dir.path().join("ck").display().to_string());
    let out = run(&dir.path().join("store"), &a);
    assert!(
        out.contains("mixed precision bf16 (forward in BF16)"),
        "{out}"
    );
    let acc = accuracy_of(&out);
    assert!(acc > 90.0, "accuracy {acc}% after 4 bf16 epochs:\n{out}");
}
