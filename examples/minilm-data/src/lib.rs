//! What the MiniLM examples share, whichever framework runs the model
//! (`examples/tch-minilm`, `examples/candle-minilm`): the sentences, the
//! reference similarities their tests check, and where `make minilm-setup`
//! puts all-MiniLM-L6-v2.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::path::{Path, PathBuf};

use accel_api::{Error, ErrorKind};

/// The example sentences of `make infer-demo` (the pairs (0, 1) and (2, 3)
/// are the ones whose sentence-transformers similarities are known).
pub const SENTENCES: [&str; 6] = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome",
    "The new movie is so great",
    "A man is playing a guitar.",
    "The cat sits outside",
];

/// Cosine similarities of [`SENTENCES`] to four decimals: (0, 1) and (2, 3)
/// are sentence-transformers' published values (issue 20); the others come
/// from `tools/minilm_reference.py` (NumPy, Python `tokenizers`), which
/// gives those two as well (docs/inference.md).
pub const REFERENCE: [(usize, usize, f32); 8] = [
    (0, 1, 0.7553),
    (2, 3, 0.8939),
    (0, 2, -0.0402),
    (0, 4, 0.2765),
    (1, 4, 0.2747),
    (1, 5, 0.1036),
    (3, 4, -0.0134),
    (4, 5, 0.0244),
];

/// Where `make minilm-setup` (scripts/fetch_minilm.sh) unpacks the model:
/// `$ACCEL_MINILM_DIR`, else `<repo>/.accel-cache/minilm/model`.
pub fn default_model_dir() -> PathBuf {
    std::env::var_os("ACCEL_MINILM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.accel-cache/minilm/model")
        })
}

/// The error for a model folder that is missing or malformed, naming the
/// folder and what is wrong, with the fix.
pub fn bad_model(dir: &Path, what: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::InvalidConfig,
        format!("MiniLM model in {}: {what}", dir.display()),
    )
    .with_fix("run `make minilm-setup` (scripts/fetch_minilm.sh) or set ACCEL_MINILM_DIR")
}

/// The model folder for a test: [`default_model_dir`] when it holds the
/// model; `None` after saying why when it does not (a failure under CI,
/// where `make test` fetches it: a skip is not a pass).
pub fn model_dir_for_test() -> Option<PathBuf> {
    let dir = default_model_dir();
    if dir.join("model.safetensors").exists() {
        return Some(dir);
    }
    let msg = format!(
        "no MiniLM model at {}: run `make minilm-setup` (scripts/fetch_minilm.sh)",
        dir.display()
    );
    assert!(std::env::var_os("CI").is_none(), "{msg}");
    eprintln!("skipped: {msg}");
    None
}
