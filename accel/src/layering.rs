//! The facade's layering (ADR 0028, "the training stack stays in the
//! facade"): `train/` and `zero/` are built over the runtime, never the
//! other way round, so that they can still become a crate of their own
//! without a cycle. A runtime file (a file of `src/` outside `train/` and
//! `zero/`, but `lib.rs`, which declares and re-exports) never names the
//! training stack: the settings the launcher hands every worker (mixed
//! precision, the ZeRO stage) are protocol values of `accel_api::worker`.

use std::path::Path;

/// What the runtime may name of the training stack: nothing (the worker
/// environment's settings live in `accel_api::worker`).
const ALLOWED: [&str; 0] = [];

#[test]
fn the_runtime_never_names_the_training_stack() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut checked = 0;
    // Every runtime file, in its folders too (`accelerator/`), but the
    // training stack's own folders.
    let mut dirs = vec![src.clone()];
    let mut files = Vec::new();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                if dir != src || !["train", "zero"].iter().any(|s| path.ends_with(s)) {
                    dirs.push(path);
                }
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    for path in files {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let top = path.parent() == Some(src.as_path());
        if !name.ends_with(".rs") || (top && (name == "lib.rs" || name == "layering.rs")) {
            continue;
        }
        checked += 1;
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for stack in ["train", "zero"] {
                for (at, _) in code.match_indices(&format!("{stack}::")) {
                    let before = &code[..at];
                    if !(before.ends_with("crate::") || before.ends_with("super::")) {
                        continue;
                    }
                    let item: String = code[at..]
                        .chars()
                        .skip(stack.len() + 2)
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    let named = format!("{stack}::{item}");
                    assert!(
                        ALLOWED.contains(&named.as_str()),
                        "{}:{}: the runtime names `{named}`; the training stack sits over \
                         the runtime (ADR 0028): move what both need below `train/` and \
                         `zero/` (a worker setting: to accel_api::worker)",
                        path.display(),
                        i + 1
                    );
                }
            }
        }
    }
    assert!(
        checked > 10,
        "found only {checked} runtime files in {}",
        src.display()
    );
}
