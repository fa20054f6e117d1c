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

/// A Python that can import `module` (e.g. `tensorboard`): `$ACCEL_PYTHON`,
/// else the workspace's `.venv-tb` (`make venv-tb`). `None` after a skip
/// ([`python_from`]).
pub fn venv_tb_python(module: &str) -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-tb/bin/python");
    let candidates = std::env::var_os("ACCEL_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .chain([venv])
        .collect();
    python_from(
        candidates,
        &format!("import {module}"),
        "`make venv-tb` installs it",
    )
}

/// One tag's scalars in a TensorBoard run: (step, value), NaN as `None`.
pub type Scalars = std::collections::BTreeMap<String, Vec<(u64, Option<f64>)>>;

/// Every scalar of the TensorBoard event files in `dir`, read with
/// TensorBoard's own reader; `None` after a skip when no Python has
/// tensorboard ([`venv_tb_python`]).
pub fn tensorboard_scalars(dir: &Path) -> Option<Scalars> {
    let py = venv_tb_python("tensorboard")?;
    let script = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1])
acc.Reload()
out = {tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
print(json.dumps(out))
"#;
    let text = run_python(&py, script, &[dir]).replace("NaN", "null");
    Some(serde_json::from_str(&text).expect("the reader's JSON"))
}
