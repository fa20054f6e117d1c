//! Finding and running the Python a test compares against (the torch venv,
//! `.venv-tb`).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::child;

/// Where the torch venv's Python may be, first choice first:
/// `$ACCEL_TORCH_PYTHON`, then the venv `make torch-venv` makes under
/// `repo` (the workspace root).
pub fn torch_python_candidates(repo: &Path) -> Vec<PathBuf> {
    std::env::var_os("ACCEL_TORCH_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .chain([repo.join(".accel-cache/torch-venv/bin/python")])
        .collect()
}

/// The first of `candidates` that can `import` (Python's statement, e.g.
/// `import torch, huggingface_hub`). `None` prints why; under CI a missing
/// one fails the test instead (the Makefile makes it). `how` says how to
/// get one.
pub fn python_from(candidates: Vec<PathBuf>, import: &str, how: &str) -> Option<PathBuf> {
    for py in &candidates {
        let ok = Command::new(py)
            .args(["-c", import])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Some(py.clone());
        }
    }
    crate::skips::skip(&format!(
        "no Python that can `{import}` (tried {candidates:?}; {how})"
    ));
    None
}

/// [`python_from`] for a Python that has `modules`, found without
/// importing them (torch's import alone takes seconds).
pub fn python_with(candidates: Vec<PathBuf>, modules: &[&str], how: &str) -> Option<PathBuf> {
    let check = format!(
        "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in {modules:?})) # find {}",
        modules.join(", ")
    );
    python_from(candidates, &check, how)
}

/// Run `script` with `args`; its stdout. Panics with Python's stderr when
/// it fails.
pub fn run_python(py: &Path, script: &str, args: &[&Path]) -> String {
    let mut cmd = Command::new(py);
    cmd.arg("-c").arg(script).args(args);
    String::from_utf8(child::output_ok(&mut cmd, "python").stdout).unwrap()
}

/// Run the script file `script` with `args`; its stdout. Panics with
/// Python's stderr when it fails.
pub fn run_python_file(py: &Path, script: &Path, args: &[&OsStr]) -> String {
    let mut cmd = Command::new(py);
    cmd.arg(script).args(args);
    let what = script.display().to_string();
    String::from_utf8(child::output_ok(&mut cmd, &what).stdout).unwrap()
}
