//! The repository's shell scripts, on a machine without a GPU: shellcheck
//! over every one, and the dry run of `scripts/gpu_check.sh`.

use std::path::Path;
use std::process::Command;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

const SCRIPTS: [&str; 3] = [
    "scripts/gpu_check.sh",
    "scripts/gpu_check_build.sh",
    "scripts/nccl_libdir.sh",
];

/// Every shell script of the repository (`make setup` installs
/// shellcheck; without it the test is skipped, a failure under make test).
#[test]
fn scripts_pass_shellcheck() {
    let mut scripts: Vec<String> = std::fs::read_dir(root().join("scripts"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sh"))
        .map(|p| format!("scripts/{}", p.file_name().unwrap().to_string_lossy()))
        .collect();
    scripts.sort();
    for s in SCRIPTS {
        assert!(scripts.iter().any(|x| x == s), "{s} is gone");
    }
    scripts.push(".ci/run".into());
    let Ok(out) = Command::new("shellcheck")
        .args(["-S", "warning"])
        .args(&scripts)
        .current_dir(root())
        .output()
    else {
        accel_test_support::skips::skip("shellcheck is not installed (make setup installs it)");
        return;
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn gpu_check_dry_run_lists_every_step() {
    let t = tempfile::tempdir().unwrap();
    let bin = tempfile::tempdir().unwrap();
    let out = Command::new("timeout")
        .arg("60")
        .arg("bash")
        .arg("scripts/gpu_check.sh")
        .arg(t.path())
        .arg("--dry-run")
        .env("ACCEL_GPU_BIN", bin.path())
        .current_dir(root())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "missing",
        "accel env --json",
        "ACCEL_REQUIRE_GPU=1",
        "test --backend cuda-nccl -n 1",
        "bench --backend cuda-nccl -n 1",
        "nccl_device_bench",
        "--async 4",
        "test --backend xla -n 1",
    ] {
        assert!(
            stdout.contains(want),
            "`{want}` not in the dry run:\n{stdout}"
        );
    }
    let summary = std::fs::read_to_string(t.path().join("summary.txt")).unwrap();
    assert!(summary.contains("would run"), "{summary}");
}

#[test]
fn nccl_libdir_links_the_soname() {
    let t = tempfile::tempdir().unwrap();
    let lib = t.path().join("libnccl.so.2");
    std::fs::write(&lib, b"").unwrap();
    let into = t.path().join("links");
    let out = Command::new("bash")
        .arg("scripts/nccl_libdir.sh")
        .arg(&into)
        .env("ACCEL_NCCL_LIB", &lib)
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        into.to_str().unwrap()
    );
    assert_eq!(std::fs::read_link(into.join("libnccl.so")).unwrap(), lib);
}
