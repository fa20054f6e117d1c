//! The benchmark runs: the binary on one process (1 step per stage, under
//! a hard timeout) prints both tables, and the library on 2 rank threads
//! over cpu-gloo reports the memory the stages promise. No timing is
//! asserted.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use accel::zero::Stage;
use accel_example_zero_bench::{run, summarize, Config, Run};

#[test]
fn the_binary_prints_a_row_per_stage_on_one_process() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zero-bench"));
    cmd.args(["--model", "tiny", "--steps", "1", "--rounds", "1"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // No launcher: one process on the `single` backend.
    for (k, _) in std::env::vars() {
        if k.starts_with("ACCEL_") || ["RANK", "WORLD_SIZE", "LOCAL_RANK"].contains(&k.as_str()) {
            cmd.env_remove(k);
        }
    }
    let mut child = cmd.spawn().expect("zero-bench starts");
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("zero-bench ran past 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for stage in ["ddp", "none", "optimizer", "gradients", "full"] {
        let rows = text
            .lines()
            .filter(|l| l.starts_with(&format!("| {stage} |")));
        assert_eq!(
            rows.count(),
            2,
            "a memory and a time row for {stage}:\n{text}"
        );
    }
    // The binary counts its heap: the stages' figures are not 0.
    let none = text.lines().find(|l| l.starts_with("| none |")).unwrap();
    let heap: f64 = none
        .split('|')
        .nth(8)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(heap > 0.0, "{none}");
}

#[test]
fn two_ranks_hold_the_shards_the_stages_promise() {
    let cfg = Config {
        widths: vec![8, 16, 16, 1],
        batch: 4,
        warmup: 1,
        steps: 1,
        rounds: 1,
        stages: vec![
            Run::Ddp,
            Run::Zero(Stage::None),
            Run::Zero(Stage::Optimizer),
            Run::Zero(Stage::Gradients),
            Run::Zero(Stage::Full),
        ],
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let c = cfg.clone();
    std::thread::spawn(move || {
        let out = accel::Threads::new(2)
            .backend("cpu-gloo")
            .timeout(Duration::from_secs(30))
            .run(|acc| run(acc, &c));
        let _ = tx.send(out);
    });
    let ranks = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("2 ranks within 120 s")
        .expect("the benchmark runs");
    // Every rank got the same samples.
    assert_eq!(ranks[0], ranks[1]);
    let sums = summarize(&ranks[0], &cfg.stages);
    let numel = (8 + 1) * 16 + (16 + 1) * 16 + 17;
    let by = |s: &str| sums.iter().find(|x| x.stage == s).unwrap().memory;
    assert_eq!(by("none").numel, numel);
    assert_eq!(by("none").opt_state, numel);
    for s in ["optimizer", "gradients", "full"] {
        let m = by(s);
        // Units of 144, 272 and 17 elements: 72 + 136 + 9 per rank.
        assert_eq!(m.shard_numel, 72 + 136 + 9, "{s}");
        assert_eq!(m.opt_state, m.shard_numel, "{s}");
    }
    for s in ["none", "optimizer", "gradients"] {
        assert_eq!(by(s).model_values_between, numel, "{s}");
    }
    for s in ["none", "optimizer"] {
        assert_eq!(by(s).model_grads_peak, numel, "{s}");
    }
    // Stage 2: a unit's gradients live from its backward to its
    // reduce-scatter only.
    let grads = by("gradients");
    assert_eq!(
        (grads.model_grads_peak, grads.model_grads_between),
        (272, 0)
    );
    let full = by("full");
    assert_eq!(
        (full.model_values_between, full.model_grads_between),
        (0, 0)
    );
    // ddp: the whole model and a momentum buffer per parameter.
    assert_eq!(by("ddp").model_values_between, numel);
    assert_eq!(by("ddp").opt_state, numel);
    assert_eq!(full.largest_unit, 272);
    assert_eq!(full.model_values_peak, 272, "one unit at a time");
}
