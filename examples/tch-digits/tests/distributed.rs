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
use std::time::Duration;

use accel_example_tch_digits::Digits;
use accel_test_support::demo_ranks;
use demo_ranks::{accuracy_in, args, final_line};

const LIMIT: Duration = Duration::from_secs(180);

fn data() -> PathBuf {
    demo_ranks::digits_data(Digits::default_path())
}

/// Run the demo on `world` ranks (`single` for 1, cpu-gloo otherwise) and
/// return rank 0's stdout.
fn run(world: usize, store: &Path, args: &[String]) -> String {
    let backend = if world == 1 { "single" } else { "cpu-gloo" };
    let exe = env!("CARGO_BIN_EXE_tch-digits");
    demo_ranks::run_ranks(exe, world, backend, store, args, LIMIT, |cmd| {
        cmd.args(["--threads", "1"]);
    })
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

#[test]
fn stopped_and_resumed_run_ends_bit_identical() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log_dir = |dir: &Path, ck: &str| {
        let runs = dir.join(format!("{ck}-runs"));
        vec!["--log-dir".to_string(), runs.display().to_string()]
    };
    let run2 = |store: &Path, args: &[String]| run(2, store, args);
    demo_ranks::stop_and_resume(dir.path(), &data(), run2, log_dir);
}

/// Four epochs with bf16 compute and gradient clipping.
const BF16_4_EPOCHS: [&str; 9] = [
    "--epochs",
    "4",
    "--save-every",
    "0",
    "--no-log",
    "--mixed-precision",
    "bf16",
    "--max-grad-norm",
    "5",
];

#[test]
fn two_ranks_learn_the_digits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let list = ["--epochs", "4", "--save-every", "0"];
    let mut a = demo_ranks::demo_args(&list, &data(), &dir.path().join("ck"));
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
    // Per-phase times and straggler scores of the phases accel times itself
    // (backward, sync, optimizer), every 50 optimizer steps (the default),
    // in both trackers.
    for tag in [
        "phase/backward_ms",
        "phase/sync_ms",
        "phase/optimizer_ms",
        "straggler/backward",
        "straggler/backward_rank",
    ] {
        assert!(
            lines.contains(&format!("\"{tag}\"")),
            "no {tag} in metrics.jsonl:\n{lines}"
        );
    }
    if let Some(got) = accel_test_support::python::tensorboard_scalars(&run_dir) {
        for tag in [
            "phase/backward_ms",
            "phase/optimizer_ms",
            "straggler/backward",
            "loss",
        ] {
            assert!(
                got.contains_key(tag),
                "no {tag} in the event file: {:?}",
                got.keys()
            );
        }
    }
    let last = final_line(&out);
    assert!(last.contains("over 360 held-out images"), "{last}");
    let acc = accuracy_in(last);
    assert!(acc > 90.0, "accuracy {acc}% after 4 epochs:\n{out}");
}

#[test]
fn two_ranks_learn_the_digits_in_bf16() {
    let dir = tempfile::tempdir().expect("tempdir");
    let list = BF16_4_EPOCHS;
    let a = demo_ranks::demo_args(&list, &data(), &dir.path().join("ck"));
    let out = run(2, &dir.path().join("store"), &a);
    assert!(out.contains("mixed precision bf16"), "{out}");
    let last = final_line(&out);
    let acc = accuracy_in(last);
    assert!(acc > 90.0, "accuracy {acc}% after 4 bf16 epochs:\n{out}");
}

/// 20 optimizer steps on 2 ranks end with the same parameters, bit for
/// bit, whether each gradient bucket is all-reduced while libtorch's
/// backward runs (started from its gradient hooks: the default) or after
/// it (`--no-overlap`), in f32 and in bf16.
#[test]
fn overlapped_and_blocking_gradient_sync_end_bit_identical() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = data();
    let dump = |name: &str, extra: &[&str]| {
        let mut list = vec![
            "--train-len",
            "320",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--accumulation",
            "1",
            "--no-eval",
            "--save-every",
            "0",
            "--no-log",
        ];
        list.extend(extra);
        let mut a = demo_ranks::demo_args(&list, &data, &dir.path().join(format!("ck-{name}")));
        let out = dir.path().join(format!("{name}.bin"));
        a.push("--dump-params".into());
        a.push(out.display().to_string());
        let text = run(2, &dir.path().join(format!("store-{name}")), &a);
        assert!(final_line(&text).contains("20 steps"), "{text}");
        read_params(&out)
    };
    for precision in ["no", "bf16"] {
        let p = ["--mixed-precision", precision];
        let overlapped = dump(&format!("overlap-{precision}"), &p);
        let blocking = dump(
            &format!("blocking-{precision}"),
            &[&p[..], &["--no-overlap"]].concat(),
        );
        assert!(!overlapped.is_empty());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&overlapped),
            bits(&blocking),
            "{precision}: overlapped and blocking gradient sync differ"
        );
    }
}
