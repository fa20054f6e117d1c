//! `accel env`: the Foundation issue's done-when checks.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).parent().unwrap();
    let built =
        accel_conformance::harness::build_cdylibs(workspace, target, &["accel-vendor-plugin"])
            .unwrap_or_else(|e| panic!("{e}"));
    let good: PathBuf = built
        .into_iter()
        .find(|p| p.to_string_lossy().contains("accel_vendor_plugin"))
        .expect("vendor plugin built");
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("libbroken.so");
    std::fs::write(&broken, b"this is not an ELF file").unwrap();
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
