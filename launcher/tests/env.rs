//! `accel env`: the Foundation issue's done-when checks.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::LIMIT;

fn accel(envs: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_accel"));
    cmd.arg("env").args(args);
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "ACCEL_BACKEND",
        "ACCEL_PLUGIN_PATH",
    ] {
        cmd.env_remove(v);
    }
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().expect("run accel env")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn plain_shell_shows_single_available_and_selected() {
    let o = accel(&[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    let row = common::env_row(&t, "single");
    assert!(row.contains("yes"), "{row}");
    assert!(t.contains("Selected backend: single"), "{t}");

    let o = accel(&[], &["--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let single = common::env_json_backend(&o.stdout, "single");
    assert_eq!(single["probe"]["availability"]["status"], "available");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(v["process"]["world_size"], 1);
}

#[cfg(feature = "cpu-gloo")]
#[test]
fn a_missing_private_gloo_shim_makes_cpu_gloo_unavailable_with_the_reason() {
    let o = accel(
        &[(
            "ACCEL_GLOO_SHIM_LIB",
            "/nonexistent/libaccel_gloo_private.so",
        )],
        &["--json"],
    );
    assert!(o.status.success(), "{}", text(&o));
    let gloo = common::env_json_backend(&o.stdout, "cpu-gloo");
    assert_eq!(
        gloo["probe"]["availability"]["status"], "unavailable",
        "{gloo}"
    );
    let why = gloo["probe"]["availability"]["reason"]
        .as_str()
        .unwrap_or_default();
    assert!(
        why.contains("/nonexistent/libaccel_gloo_private.so")
            && why.contains("ACCEL_GLOO_SHIM_LIB"),
        "{why}"
    );
    let o = accel(&[], &["--json"]);
    let gloo = common::env_json_backend(&o.stdout, "cpu-gloo");
    assert_eq!(
        gloo["probe"]["availability"]["status"], "available",
        "{gloo}"
    );
}

#[test]
fn rank_beyond_world_size_is_an_error_naming_rank() {
    let o = accel(&[("RANK", "5"), ("WORLD_SIZE", "2")], &[]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains("RANK=5") && t.contains("WORLD_SIZE=2"), "{t}");
}

#[test]
fn loaded_and_broken_plugins_are_both_reported() {
    let (workspace, target) = common::workspace_and_target();
    let built =
        accel_conformance::harness::build_cdylibs(workspace, target, &["accel-vendor-plugin"])
            .unwrap_or_else(|e| panic!("{e}"));
    let good: PathBuf = built
        .into_iter()
        .find(|p| p.to_string_lossy().contains("accel_vendor_plugin"))
        .expect("vendor plugin built");
    let (_dir, broken) = common::temp_file("libbroken.so", b"this is not an ELF file");
    let path = format!("{}:{}", good.display(), broken.display());

    let o = accel(&[("ACCEL_PLUGIN_PATH", &path)], &[]);
    assert!(
        o.status.success(),
        "a broken plugin must not stop accel env: {}",
        text(&o)
    );
    let t = text(&o);
    assert!(t.contains("loaded") && t.contains("vendor-single"), "{t}");
    let failed = t
        .lines()
        .find(|l| l.contains("FAILED"))
        .expect("a FAILED plugin line");
    assert!(failed.contains("libbroken.so"), "{failed}");

    let o = accel(&[("ACCEL_PLUGIN_PATH", &path)], &["--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let plugins = v["plugins"].as_array().unwrap();
    assert!(
        plugins
            .iter()
            .any(|p| p["loaded"] == true && p["backend"] == "vendor-single"),
        "{v}"
    );
    let bad = plugins
        .iter()
        .find(|p| p["loaded"] == false)
        .expect("broken plugin row");
    assert!(bad["path"].as_str().unwrap().ends_with("libbroken.so"));
    assert!(!bad["reason"].as_str().unwrap().is_empty());
}

/// A launcher killed with SIGKILL cannot stop its workers; the runtime's
/// lifeline (PR_SET_PDEATHSIG) makes the kernel stop them instead.
#[test]
fn workers_die_with_a_killed_launcher() {
    use std::io::{BufRead, BufReader};
    use std::time::{Duration, Instant};
    let exe = env!("CARGO_BIN_EXE_accel");
    let mut child = Command::new(exe)
        .args([
            "launch",
            "-n",
            "2",
            "--",
            exe,
            "probe-worker",
            "--accelerator",
            "--hold",
            "60",
        ])
        .env_remove("ACCEL_BACKEND")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut pids = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while pids.len() < 2 && Instant::now() < deadline {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(200)) {
            if let Some(json) = line.split_once("] ").map(|(_, j)| j) {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(json) {
                    pids.push(v["pid"].as_i64().unwrap() as i32);
                }
            }
        }
    }
    assert_eq!(pids.len(), 2, "both workers reported");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let _ = child.wait();
    let deadline = Instant::now() + Duration::from_secs(10);
    let alive = |p: i32| {
        std::path::Path::new(&format!("/proc/{p}")).exists()
            && !std::fs::read_to_string(format!("/proc/{p}/stat"))
                .unwrap_or_default()
                .contains(") Z ")
    };
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    for p in pids {
        assert!(!alive(p), "worker {p} outlived its SIGKILLed launcher");
    }
}

use accel_test_support::env_cases;

/// Environments the probing found `accel env` calling OK while the worker
/// refused them (issue 32 item 4), and the decided edge cases: (case,
/// variables, what the refusal must say; empty: accepted).
#[rustfmt::skip]
const WHOLE: &[(&str, env_cases::Env, &str)] = &[
    ("unknown backend", &[("ACCEL_BACKEND", "nonexistent")], "nonexistent"),
    ("empty MASTER_ADDR", &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", ""), ("MASTER_PORT", "29500")], "MASTER_ADDR is set but empty"),
    ("empty MASTER_ADDR, one process", &[("MASTER_ADDR", " ")], "MASTER_ADDR is set but empty"),
    ("http store", &[("ACCEL_STORE_URL", "http://x")], "unknown scheme"),
    ("store port out of range", &[("ACCEL_STORE_URL", "tcp://127.0.0.1:99999")], "not in 1..=65535"),
    ("relative file store", &[("ACCEL_STORE_URL", "file://tmp/x")], "absolute path"),
    ("timeout of 100 ns", &[("ACCEL_TIMEOUT", "100ns")], "below the shortest timeout"),
    ("timeout of 1 ms", &[("ACCEL_TIMEOUT", "1ms")], ""),
    // Read by the mpi backend only; the others ignore it.
    ("mpi staging, no mpi", &[("ACCEL_MPI_STAGING_BYTES", "abc")], ""),
    ("memory store", &[("ACCEL_STORE_URL", "memory:")], ""),
];

/// How one entry point judged an environment: `None` accepted (or still
/// connecting at the deadline), `Some((exit code, message))` refused.
type Verdict = Option<(i32, String)>;

/// Run `accel ARGS` in an environment holding only `kv` of the variables
/// accel reads; kill it after `limit`.
fn judged(kv: &[(&str, &str)], args: &[&str], limit: Duration) -> (Verdict, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_accel"));
    cmd.args(args);
    let read_by_accel = |k: &str| {
        const PREFIXES: &[&str] = &[
            "ACCEL_",
            "OMPI_",
            "PMI",
            "MV2_",
            "MPI_",
            "SLURM_",
            "TORCHELASTIC_",
        ];
        const NAMES: &[&str] = &[
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "GROUP_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ];
        PREFIXES.iter().any(|p| k.starts_with(p)) || NAMES.contains(&k)
    };
    for (k, _) in std::env::vars() {
        if read_by_accel(&k) {
            cmd.env_remove(k);
        }
    }
    if !kv.iter().any(|(k, _)| *k == "ACCEL_TIMEOUT") {
        // A valid multi-process environment connects: bound the wait.
        cmd.env("ACCEL_TIMEOUT", "2s");
    }
    if !kv.iter().any(|(k, _)| *k == "ACCEL_BACKEND") {
        // The backend fixed, so that the verdict is the environment's: with
        // the mpi backend compiled in (the workspace's features), what a
        // faked MPI environment reaches is only known to MPI_Init.
        cmd.env("ACCEL_BACKEND", "cpu-gloo");
    }
    cmd.envs(kv.iter().copied())
        .env("RUST_BACKTRACE", "0")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("start accel");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let out = child.wait_with_output().expect("output");
    let all = text(&out);
    let verdict = match status.and_then(|s| s.code()) {
        Some(0) | None => None,
        Some(code) => Some((code, all.clone())),
    };
    (verdict, all)
}

/// `accel env --json`'s verdict: the JSON's `verdict.Err`, or the error
/// line when the process state itself is refused.
fn env_verdict(kv: &[(&str, &str)]) -> (Verdict, String) {
    let (v, all) = judged(kv, &["env", "--json"], LIMIT);
    let v = v.map(|(code, all)| {
        let json = all.find('{').and_then(|i| {
            serde_json::from_str::<serde_json::Value>(&all[i..all.rfind('}')? + 1]).ok()
        });
        let msg = match json {
            Some(j) => j["verdict"]["Err"].as_str().unwrap_or_default().to_string(),
            None => all
                .lines()
                .find_map(|l| l.strip_prefix("accel: error: "))
                .unwrap_or_default()
                .to_string(),
        };
        (code, msg)
    });
    (v, all)
}

/// How `accel env` and a worker (`accel probe-worker --accelerator`,
/// which runs `Accelerator::new`) disagree on environment `kv`, if they
/// do; `says`: what the refusal must say (empty: accepted; `*`: either).
fn disagreement(case: &str, kv: &[(&str, &str)], says: &str) -> Option<String> {
    let (env, env_all) = env_verdict(kv);
    let worker_args = ["probe-worker", "--no-barrier", "--accelerator"];
    let (worker, worker_all) = judged(kv, &worker_args, Duration::from_secs(8));
    match (&env, &worker) {
        (Some((code, msg)), Some((wcode, wall))) => {
            if msg.is_empty() || !wall.contains(msg.as_str()) || code != wcode {
                return Some(format!(
                    "{case}: env refused (exit {code}: {msg}), the worker said (exit {wcode}):\n{wall}"
                ));
            }
        }
        (Some((code, msg)), None) => {
            return Some(format!(
                "{case}: env refused (exit {code}: {msg}), the worker accepted:\n{worker_all}"
            ))
        }
        // Accepted by the check; a worker may still fail to connect (no
        // peers), but not refuse the configuration (exit 2).
        (None, Some((2, wall))) => {
            return Some(format!(
                "{case}: env accepted, the worker refused its configuration:\n{wall}\n{env_all}"
            ))
        }
        (None, _) => {}
    }
    match (&env, says) {
        (_, "*") => None,
        (Some((_, msg)), "") => Some(format!("{case}: refused: {msg}")),
        (Some((_, msg)), says) if !msg.contains(says) => {
            Some(format!("{case}: the refusal does not say {says:?}: {msg}"))
        }
        (None, says) if !says.is_empty() => {
            Some(format!("{case}: accepted, expected {says:?}:\n{env_all}"))
        }
        _ => None,
    }
}

/// Every case of the environment tests, through `accel env` and through a
/// worker's `Accelerator::new` (`accel probe-worker --accelerator`): the
/// same verdict, and for a refusal the same exit code and message.
#[test]
fn accel_env_and_the_worker_give_the_same_verdict_on_every_case() {
    let bad = env_cases::BAD.iter().map(|(c, kv, var)| (*c, *kv, *var));
    // Read by the state parser; the whole check may still refuse them (no
    // store named for several processes): only the agreement counts.
    let good = env_cases::GOOD.iter().map(|(c, kv, ..)| (*c, *kv, "*"));
    let cases: Vec<(&str, env_cases::Env, &str)> =
        bad.chain(good).chain(WHOLE.iter().copied()).collect();
    let wrong: Vec<String> = cases
        .iter()
        .filter_map(|(case, kv, says)| disagreement(case, kv, says))
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} cases:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n\n")
    );
}

/// A fixed sample of the facade's fuzzed environments (the same
/// generator, a deterministic seed), through both entries: the same
/// verdict on each.
#[test]
fn accel_env_and_the_worker_agree_on_fuzzed_environments() {
    use proptest::strategy::{Strategy, ValueTree};
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let reach = env_cases::generate::Reach {
        known_crashes: false,
    };
    let strategy = env_cases::generate::vars(reach);
    let mut wrong = Vec::new();
    const SAMPLE: usize = 40;
    for i in 0..SAMPLE {
        let vars = strategy.new_tree(&mut runner).unwrap().current();
        let kv: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        if let Some(w) = disagreement(&format!("sample {i} {vars:?}"), &kv, "*") {
            wrong.push(w);
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {SAMPLE}:\n{}",
        wrong.len(),
        wrong.join("\n\n")
    );
}
