//! Running an example's binary as rank processes, the way torchrun starts
//! them (`RANK`, `WORLD_SIZE`, ... and a file store, so no launcher binary
//! is needed), all under one hard deadline, and reading the digits demos'
//! output.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The digits data set at `path` (`Digits::default_path()`), after
/// asserting that it is there.
pub fn digits_data(path: PathBuf) -> PathBuf {
    assert!(
        path.exists(),
        "{} is missing: run scripts/digits_data.sh (or make tch-setup) first",
        path.display()
    );
    path
}

/// Owned copies of `list`.
pub fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Wait for `child` at most until `deadline`; kill it after (`limit` is
/// named in the failure).
fn wait_bounded(mut child: Child, deadline: Instant, limit: Duration) -> Output {
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "a rank ran past {limit:?}; stdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Run `exe args` as `world` ranks over `backend`, with a file store in
/// `store` (whose name is the run id), every rank within `limit`;
/// `configure` adds a demo's own arguments and variables to each. Fails
/// the test when a rank fails. Rank 0's stdout.
pub fn run_ranks(
    exe: &str,
    world: usize,
    backend: &str,
    store: &Path,
    args: &[String],
    limit: Duration,
    configure: impl Fn(&mut Command),
) -> String {
    std::fs::create_dir_all(store).expect("store dir");
    let children: Vec<Child> = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(exe);
            cmd.args(args);
            configure(&mut cmd);
            cmd.env("RANK", rank.to_string())
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
                .unwrap_or_else(|e| panic!("starting {exe}: {e}"))
        })
        .collect();
    let deadline = Instant::now() + limit;
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| wait_bounded(c, deadline, limit))
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

/// The parameter checksum a demo printed last.
pub fn checksum_of(stdout: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.split("params checksum ").nth(1))
        .unwrap_or_else(|| panic!("no checksum in:\n{stdout}"))
        .trim()
        .to_string()
}

/// A digits demo's `final:` line.
pub fn final_line(out: &str) -> &str {
    out.lines()
        .find(|l| l.starts_with("final:"))
        .unwrap_or_else(|| panic!("no final line:\n{out}"))
}

/// The held-out accuracy (percent) on a digits demo's `final:` line.
pub fn accuracy_in(last: &str) -> f64 {
    last.split("accuracy ")
        .nth(1)
        .and_then(|s| s.split('%').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {last}"))
}

/// `list`, then `--data data --checkpoint-dir checkpoints`.
pub fn demo_args(list: &[&str], data: &Path, checkpoints: &Path) -> Vec<String> {
    let mut a = args(list);
    a.extend(["--data".into(), data.display().to_string()]);
    a.extend(["--checkpoint-dir".into(), checkpoints.display().to_string()]);
    a
}

/// The exact-resume check of the digits demos, in `dir`: an
/// uninterrupted 2-epoch run on 400 images with a checkpoint every 4
/// steps, a run stopped after step 11, and that run resumed, which must
/// end with the uninterrupted run's checksum. `run(store, args)` runs the
/// demo; `extra(dir, name)` adds a demo's own arguments for the run with
/// checkpoints in `dir/name`. The three outputs.
pub fn stop_and_resume(
    dir: &Path,
    data: &Path,
    run: impl Fn(&Path, &[String]) -> String,
    extra: impl Fn(&Path, &str) -> Vec<String>,
) -> (String, String, String) {
    let base = |ck: &str| {
        let list = [
            "--train-len",
            "400",
            "--epochs",
            "2",
            "--save-every",
            "4",
            "--keep",
            "2",
        ];
        let mut a = demo_args(&list, data, &dir.join(ck));
        a.extend(extra(dir, ck));
        a
    };
    let full = run(&dir.join("s1"), &base("full"));
    let mut stop = base("cut");
    stop.extend(args(&["--stop-after", "11"]));
    let stopped = run(&dir.join("s2"), &stop);
    assert!(stopped.contains("stopped at step 11"), "{stopped}");
    let mut resume = base("cut");
    resume.push("--resume".into());
    let resumed = run(&dir.join("s3"), &resume);
    assert!(resumed.contains("resumed from"), "{resumed}");
    assert_eq!(
        checksum_of(&full),
        checksum_of(&resumed),
        "full:\n{full}\nresumed:\n{resumed}"
    );
    (full, stopped, resumed)
}

/// The tests the pure-Rust digits demos (candle's, burn's) share, on 2
/// ranks over cpu-gloo with one rayon thread per rank: a run stopped 3
/// optimizer steps after a checkpoint and resumed ends bit-identical to an
/// uninterrupted one, and 10 epochs reach 95 % held out with the weights
/// saved. Defines `data()`, `run(store, args)` and `accuracy_of(stdout)` for
/// the crate's other tests. `$exe`: the demo's binary
/// (`env!("CARGO_BIN_EXE_...")`); `$data`: its data set's default path.
#[macro_export]
macro_rules! digits_demo_tests {
    (exe = $exe:expr, data = $data:expr $(,)?) => {
        const LIMIT: std::time::Duration = std::time::Duration::from_secs(240);

        fn data() -> std::path::PathBuf {
            $crate::demo_ranks::digits_data($data)
        }

        /// Run the demo on 2 ranks over cpu-gloo; rank 0's stdout.
        fn run(store: &std::path::Path, args: &[String]) -> String {
            $crate::demo_ranks::run_ranks($exe, 2, "cpu-gloo", store, args, LIMIT, |cmd| {
                // One rayon thread per rank on a small machine.
                cmd.env("RAYON_NUM_THREADS", "1");
            })
        }

        /// The held-out accuracy (percent) on rank 0's final line, which
        /// must count all 360 held-out images.
        fn accuracy_of(out: &str) -> f64 {
            let last = $crate::demo_ranks::final_line(out);
            assert!(last.contains("over 360 held-out images"), "{last}");
            $crate::demo_ranks::accuracy_in(last)
        }

        #[test]
        fn stopped_and_resumed_run_ends_bit_identical() {
            use $crate::demo_ranks::checksum_of;
            let dir = tempfile::tempdir().expect("tempdir");
            let (full, stopped, resumed) =
                $crate::demo_ranks::stop_and_resume(dir.path(), &data(), run, |_, _| Vec::new());
            assert_ne!(checksum_of(&stopped), checksum_of(&full));
            assert!(resumed.contains("at step 8"), "{resumed}");
        }

        #[test]
        fn two_ranks_reach_95_percent_held_out_in_10_epochs() {
            let dir = tempfile::tempdir().expect("tempdir");
            let list = ["--epochs", "10", "--save-every", "0"];
            let mut a = $crate::demo_ranks::demo_args(&list, &data(), &dir.path().join("ck"));
            a.push("--save-model".into());
            a.push(dir.path().join("weights").display().to_string());
            let out = run(&dir.path().join("store"), &a);
            let acc = accuracy_of(&out);
            assert!(acc >= 95.0, "accuracy {acc}% after 10 epochs:\n{out}");
            assert!(dir.path().join("weights/model.safetensors").is_file());
        }
    };
}
