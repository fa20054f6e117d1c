//! The digits demo as separate processes (every one under a hard timeout):
//!
//! * equivalence: 1 process on the `single` backend with the global batch
//!   (2 x 8 x 2 = 32 images, no accumulation) and 2 ranks on cpu-gloo with
//!   8 images each and 2 accumulation steps end with the same parameters,
//!   within float tolerance, for libtorch's SGD and for AdamW;
//! * exact resume: 2 ranks stopped 3 optimizer steps after a checkpoint
//!   (mid-epoch, mid-accumulation-cadence) and resumed end with
//!   the same parameter checksum as an uninterrupted run;
//! * the real-data run reaches a useful held-out accuracy, every held-out
//!   image counted once by gather_for_metrics.
//!
//! Ranks are started directly with torchrun-style variables and a file
//! store, so the tests need no launcher binary.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(180);

fn data() -> PathBuf {
    let p = accel_example_tch_digits::Digits::default_path();
    assert!(
        p.exists(),
        "{} is missing: run `make tch-setup` first",
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

/// Run the demo on `world` ranks (`single` for 1, cpu-gloo otherwise) and
/// return rank 0's stdout.
fn run(world: usize, store: &Path, args: &[String]) -> String {
    std::fs::create_dir_all(store).expect("store dir");
    let backend = if world == 1 { "single" } else { "cpu-gloo" };
    let children: Vec<Child> = (0..world)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_tch-digits"))
                .args(args)
                .args(["--threads", "1"])
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("ACCEL_BACKEND", backend)
                .env("ACCEL_STORE_URL", format!("file://{}", store.display()))
                .env(
                    "ACCEL_RUN_ID",
                    store.file_name().unwrap().to_string_lossy().to_string(),
                )
                .env("ACCEL_TIMEOUT", "60")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("starting tch-digits")
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
            "rank {rank} of {world} failed ({}):\nstdout:\n{}\nstderr:\n{}",
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

fn read_params(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .expect("dumped params")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn equivalence(optimizer: &str, lr: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = data();
    let common = |batch: &str, acc: &str, out: &Path, ck: &str| {
        let mut a = args(&[
            "--train-len",
            "320",
            "--epochs",
            "2",
            "--batch-size",
            batch,
            "--accumulation",
            acc,
            "--optimizer",
            optimizer,
            "--lr",
            lr,
            "--no-eval",
            "--save-every",
            "0",
            "--checkpoint-dir",
        ]);
        a.push(dir.path().join(ck).display().to_string());
        a.push("--data".into());
        a.push(data.display().to_string());
        a.push("--dump-params".into());
        a.push(out.display().to_string());
        a
    };
    let one = dir.path().join("one.bin");
    let two = dir.path().join("two.bin");
    let mut args1 = common("32", "1", &one, "ck1");
    args1.push("--no-log".into());
    let out = run(1, &dir.path().join("store1"), &args1);
    let mut args2 = common("8", "2", &two, "ck2");
    args2.push("--log-dir".into());
    args2.push(dir.path().join("runs").display().to_string());
    let out2 = run(2, &dir.path().join("store2"), &args2);
    for o in [&out, &out2] {
        assert!(!o.contains("NaN"), "--no-eval prints no NaN accuracy:\n{o}");
        assert!(o.contains("no held-out evaluation (--no-eval)"), "{o}");
    }
    assert!(dir.path().join("runs/tch-digits/metrics.jsonl").exists());
    let (a, b) = (read_params(&one), read_params(&two));
    assert_eq!(a.len(), b.len());
    let init_scale = a.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= 1e-5 * init_scale.max(1.0),
        "{optimizer}: 1 process x batch 32 and 2 ranks x 8 x 2 accumulation differ by up to {worst}"
    );
}

#[test]
fn one_process_global_batch_equals_two_ranks_with_accumulation_torch_sgd() {
    equivalence("torch-sgd", "0.1");
}

#[test]
fn one_process_global_batch_equals_two_ranks_with_accumulation_adamw() {
    equivalence("adamw", "0.003");
}

fn checksum_of(stdout: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.split("params checksum ").nth(1))
        .unwrap_or_else(|| panic!("no checksum in:\n{stdout}"))
        .trim()
        .to_string()
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
        a.push("--log-dir".into());
        a.push(dir.path().join(format!("{ck}-runs")).display().to_string());
        a
    };
    let full = run(2, &dir.path().join("s1"), &base("full"));
    let mut stop = base("cut");
    stop.extend(args(&["--stop-after", "11"]));
    let stopped = run(2, &dir.path().join("s2"), &stop);
    assert!(stopped.contains("stopped at step 11"), "{stopped}");
    let mut resume = base("cut");
    resume.push("--resume".into());
    let resumed = run(2, &dir.path().join("s3"), &resume);
    assert!(resumed.contains("resumed from"), "{resumed}");
    assert_eq!(
        checksum_of(&full),
        checksum_of(&resumed),
        "full:\n{full}\nresumed:\n{resumed}"
    );
}

#[test]
fn two_ranks_learn_the_digits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut a = args(&["--epochs", "4", "--save-every", "0", "--data"]);
    a.push(data().display().to_string());
    a.push("--checkpoint-dir".into());
    a.push(dir.path().join("ck").display().to_string());
    a.push("--log-dir".into());
    a.push(dir.path().join("runs").display().to_string());
    let out = run(2, &dir.path().join("store"), &a);
    // Both trackers: JSON Lines with a loss per step and an accuracy per
    // epoch, and a TensorBoard event file.
    let run_dir = dir.path().join("runs/tch-digits");
    let lines = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("metrics.jsonl");
    let accuracies = lines.lines().filter(|l| l.contains("\"accuracy\"")).count();
    let losses = lines.lines().filter(|l| l.contains("\"loss\"")).count();
    assert_eq!(accuracies, 4, "one accuracy per epoch:\n{lines}");
    assert!(losses > 4, "a loss per optimizer step:\n{lines}");
    let events: Vec<_> = std::fs::read_dir(&run_dir)
        .expect("run dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.to_string_lossy().contains("tfevents"))
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(std::fs::metadata(&events[0]).expect("events").len() > 100);
    let last = out
        .lines()
        .find(|l| l.starts_with("final:"))
        .unwrap_or_else(|| panic!("no final line:\n{out}"));
    assert!(last.contains("over 360 held-out images"), "{last}");
    let acc: f64 = last
        .split("accuracy ")
        .nth(1)
        .and_then(|s| s.split('%').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {last}"));
    assert!(acc > 90.0, "accuracy {acc}% after 4 epochs:\n{out}");
}

#[test]
fn two_ranks_learn_the_digits_in_bf16() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut a = args(&[
        "--epochs",
        "4",
        "--save-every",
        "0",
        "--no-log",
        "--mixed-precision",
        "bf16",
        "--max-grad-norm",
        "5",
        "--data",
    ]);
    a.push(data().display().to_string());
    a.push("--checkpoint-dir".into());
    a.push(dir.path().join("ck").display().to_string());
    let out = run(2, &dir.path().join("store"), &a);
    assert!(out.contains("mixed precision bf16"), "{out}");
    let last = out
        .lines()
        .find(|l| l.starts_with("final:"))
        .unwrap_or_else(|| panic!("no final line:\n{out}"));
    let acc: f64 = last
        .split("accuracy ")
        .nth(1)
        .and_then(|s| s.split('%').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {last}"));
    assert!(acc > 90.0, "accuracy {acc}% after 4 bf16 epochs:\n{out}");
}
