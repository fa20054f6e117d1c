//! What the MiniLM examples share, whichever framework runs the model
//! (`examples/tch-minilm`, `examples/candle-minilm`): the sentences, the
//! reference similarities their tests check, and where `make minilm-setup`
//! puts all-MiniLM-L6-v2.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::path::{Path, PathBuf};

use accel_api::{Error, ErrorKind};

// Finding the Python and skipping a test: as the tests of other crates do.
use accel_test_support::{python, skips};

/// The example sentences of `make infer-demo` (the pairs (0, 1) and (2, 3)
/// are the ones whose sentence-transformers similarities are known).
/// `tools/minilm_reference.py` reads its sentences from this list.
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
    let how = "run `make minilm-setup` (scripts/fetch_minilm.sh)";
    skips::dir_holding(
        default_model_dir(),
        "model.safetensors",
        "MiniLM model",
        how,
    )
}

/// `tools/minilm_reference.py --embeddings` (NumPy, float64, Hugging Face's
/// Python `tokenizers`): the reference embeddings of [`SENTENCES`], one unit
/// row each. Runs the first Python of `$ACCEL_PYTHON` and `.venv-tb` (`make
/// venv-tb`) that has numpy, safetensors and tokenizers; `None` after saying
/// why when there is none (a failure under CI, where `make test` makes it).
///
/// # Panics
/// When the script fails or prints something else than its JSON.
pub fn reference_embeddings_for_test(model_dir: &Path) -> Option<Vec<Vec<f64>>> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let candidates: Vec<PathBuf> = std::env::var_os("ACCEL_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .chain([repo.join(".venv-tb/bin/python")])
        .collect();
    let import = "import numpy, safetensors, tokenizers";
    let py = python::python_from(candidates, import, "run `make venv-tb`")?;
    let script = repo.join("tools/minilm_reference.py");
    let args = ["--embeddings".as_ref(), model_dir.as_os_str()];
    let out = python::run_python_file(&py, &script, &args);
    let v: serde_json::Value = serde_json::from_str(&out).expect("the script's JSON");
    let rows = v["embeddings"].as_array().expect("an embeddings list");
    Some(
        rows.iter()
            .map(|r| {
                r.as_array()
                    .expect("a row")
                    .iter()
                    .map(|x| x.as_f64().expect("a number"))
                    .collect()
            })
            .collect(),
    )
}

/// Per sentence, the cosine of `ours` with `reference` and the largest
/// difference of one coordinate (both are unit rows).
///
/// # Panics
/// When the two have other shapes.
pub fn against_reference(ours: &[Vec<f32>], reference: &[Vec<f64>]) -> Vec<(f64, f64)> {
    assert_eq!(ours.len(), reference.len(), "sentences");
    ours.iter()
        .zip(reference)
        .map(|(a, b)| {
            assert_eq!(a.len(), b.len(), "embedding width");
            let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * y).sum();
            let na = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
            let nb = b.iter().map(|y| y * y).sum::<f64>().sqrt();
            let max = a
                .iter()
                .zip(b)
                .map(|(x, y)| (f64::from(*x) - y).abs())
                .fold(0.0, f64::max);
            (dot / (na * nb), max)
        })
        .collect()
}

/// Assert that every sentence's embedding in `ours` (of [`SENTENCES`]) is
/// the reference's: cosine at least 0.9999 and no coordinate further than
/// 1e-5 off; prints both figures per sentence.
///
/// # Panics
/// On the first sentence that is off, naming it and both figures.
pub fn assert_matches_reference(ours: &[Vec<f32>], reference: &[Vec<f64>]) {
    for (i, (cos, max)) in against_reference(ours, reference).into_iter().enumerate() {
        println!("sentence {i}: cosine {cos:.9}, largest difference {max:.2e}");
        assert!(
            cos >= 0.9999 && max <= 1e-5,
            "sentence {i} {:?}: cosine {cos}, largest difference {max}",
            SENTENCES[i]
        );
    }
}

/// Assert that `sims`, the cosine similarities of [`SENTENCES`]'
/// embeddings, give [`REFERENCE`]'s within `tolerance`, are symmetric, and
/// are 1 on the diagonal (unit vectors).
///
/// # Panics
/// On the first pair that is off, naming both sentences.
pub fn assert_similarities(sims: &[Vec<f32>], tolerance: f32) {
    for &(i, j, want) in &REFERENCE {
        let got = sims[i][j];
        assert!(
            (got - want).abs() < tolerance,
            "cos({:?}, {:?}) = {got}, the reference gives {want}",
            SENTENCES[i],
            SENTENCES[j]
        );
        assert!(
            (sims[j][i] - got).abs() < 1e-6,
            "similarity matrix not symmetric"
        );
    }
    // Unit vectors: each sentence's similarity to itself is 1.
    for (i, row) in sims.iter().enumerate() {
        assert!((row[i] - 1.0).abs() < 1e-5, "cos(s{i}, s{i}) = {}", row[i]);
    }
}

/// The budgets the offload tests run the model under, in order: none
/// (all resident), `cpu=20MiB,disk` (most of the model on disk) and
/// `cpu=60MiB,disk` (a split between the CPU and disk).
pub const BUDGETS: [Option<&str>; 3] = [None, Some("cpu=20MiB,disk"), Some("cpu=60MiB,disk")];

/// Assert that the first two [`BUDGETS`] did what they say, from each
/// run's resident and on-disk bytes: nothing on disk without offload, most
/// of the 87 MiB model there with 20 MiB of CPU.
///
/// # Panics
/// Naming the figure that is off.
pub fn assert_offload_budgets(res0: u64, disk0: u64, res1: u64, disk1: u64) {
    assert_eq!(disk0, 0);
    assert!(res0 > 80 << 20, "resident bytes without offload: {res0}");
    assert!(disk1 > 60 << 20, "bytes on disk with cpu=20MiB: {disk1}");
    assert!(res1 <= 20 << 20, "resident bytes with cpu=20MiB: {res1}");
}

/// The model folder and the reference embeddings for a test:
/// [`model_dir_for_test`] and [`reference_embeddings_for_test`] of it;
/// `None` after saying why when either is missing.
pub fn model_and_reference_for_test() -> Option<(PathBuf, Vec<Vec<f64>>)> {
    let dir = model_dir_for_test()?;
    let reference = reference_embeddings_for_test(&dir)?;
    Some((dir, reference))
}
