//! `accel env` with the npu-hccl backend compiled in and no CANN: the row
//! is there, unavailable, with the reason naming the missing library, in
//! text and in `--json`.
#![cfg(feature = "npu-hccl")]

mod common;

use std::process::{Command, Output};

fn accel_env(lib_dir: &std::path::Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_accel"));
    // No RANK, ACCEL_BACKEND, ... from the caller; an empty library folder
    // gives the same answer on machines that do have CANN.
    cmd.arg("env")
        .args(args)
        .env_clear()
        .env("ACCEL_ASCEND_LIB_DIR", lib_dir);
    cmd.output().expect("run accel env")
}

#[test]
fn env_shows_npu_hccl_unavailable_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let o = accel_env(dir.path(), &[]);
    let t = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{t}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let row = common::env_row(&t, "npu-hccl");
    assert!(row.contains("libascendcl.so not found"), "{row}");
    assert!(row.contains(&dir.path().display().to_string()), "{row}");
    assert!(t.contains("Selected backend: single"), "{t}");

    let o = accel_env(dir.path(), &["--json"]);
    assert!(o.status.success());
    let npu = common::env_json_backend(&o.stdout, "npu-hccl");
    assert_eq!(npu["compiled_in"], true);
    assert_eq!(npu["probe"]["availability"]["status"], "unavailable");
    let reason = npu["probe"]["availability"]["reason"].as_str().unwrap();
    assert!(reason.starts_with("libascendcl.so not found"), "{reason}");
}
