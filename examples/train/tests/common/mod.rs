//! What the demo's integration tests share: the launcher binary beside them.

use std::path::{Path, PathBuf};

/// `target/<profile>/accel`, next to this test's `deps/` folder; built
/// with cargo when missing (a `cargo test -p accel-example-train` alone
/// does not build the launcher).
pub fn accel_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf();
    let bin = profile_dir.join("accel");
    if bin.exists() {
        return bin;
    }
    let target = profile_dir.parent().expect("target dir");
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .and_then(Path::parent)
        .expect("workspace root");
    let mut args = vec!["-p", "accel-launcher"];
    if profile_dir.file_name().and_then(|f| f.to_str()) == Some("release") {
        args.push("--release");
    }
    if let Err(e) = accel_conformance::harness::cargo_build(workspace, target, &args) {
        panic!("building accel-launcher failed: {e}");
    }
    assert!(bin.exists(), "{} was not built", bin.display());
    bin
}
