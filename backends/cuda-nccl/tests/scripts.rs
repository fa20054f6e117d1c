//! The GPU check scripts, on a machine without a GPU: shellcheck (when
//! installed) and the dry run of `scripts/gpu_check.sh`.

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

#[test]
fn scripts_pass_shellcheck_when_it_is_installed() {
    let Ok(out) = Command::new("shellcheck")
        .args(SCRIPTS)
        .current_dir(root())
        .output()
    else {
        eprintln!("skipped: shellcheck is not installed");
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
