//! Where `accel plan` and `accel estimate-memory` get a model's layout: a
//! safetensors checkpoint (with the tied weights its `config.json`
//! implies) or a layout JSON file.

use std::collections::HashMap;
use std::path::Path;

use accel_api::{Error, ErrorKind, Result};

use crate::layout::Layout;
use crate::safetensors::Checkpoint;

/// Read a model's layout from a safetensors `checkpoint` or a `layout`
/// JSON file (exactly one), with `tied` groups of comma-separated names
/// added, and notes for the user on what was inferred: the
/// module order of a bare checkpoint, and tied weights read from the
/// `config.json` next to it (`tie_word_embeddings`, true when absent as
/// in transformers, ties `lm_head.weight` to the input embedding for
/// models with a language-model head).
///
/// # Errors
/// Checkpoint and layout errors as they come; [`ErrorKind::InvalidArgument`]
/// for an unreadable `config.json` or bad tied names.
pub fn load_layout(
    checkpoint: Option<&Path>,
    layout: Option<&Path>,
    tied: &[String],
) -> Result<(Layout, Vec<String>)> {
    let mut tied: Vec<Vec<String>> = tied
        .iter()
        .map(|g| g.split(',').map(|s| s.trim().to_string()).collect())
        .collect();
    let mut notes = vec![];
    match (checkpoint, layout) {
        (Some(c), None) => {
            let ck = Checkpoint::open(c)?;
            if let Some(g) = config_tie(c, &ck, &tied)? {
                notes.push(format!(
                    "tied from config.json (tie_word_embeddings): {}",
                    g.join(" = ")
                ));
                tied.push(g);
            }
            let layout = Layout::from_checkpoint(&ck, &tied)?;
            notes.push(
                    "module order inferred from tensor names (a checkpoint does not record it): \
                     embeddings first, output heads last; pass --layout from tools/export_layout.py \
                     for the model's own order"
                        .into(),
                );
            Ok((layout, notes))
        }
        (None, Some(l)) => {
            let layout = Layout::from_json_file(l)?;
            if tied.is_empty() {
                Ok((layout, notes))
            } else {
                let mut doc = layout.to_json();
                doc.tied.extend(tied);
                Ok((Layout::from_json(&doc)?, notes))
            }
        }
        _ => Err(Error::new(
            ErrorKind::InvalidConfig,
            "give exactly one of --checkpoint and --layout",
        )),
    }
}

/// Names of input embeddings in Hugging Face models, the partner of a tied
/// `lm_head.weight`.
const INPUT_EMBEDDINGS: [&str; 6] = [
    "embed_tokens.weight",
    "wte.weight",
    "word_embeddings.weight",
    "tok_embeddings.weight",
    "shared.weight",
    "embed_in.weight",
];

/// The tied group `config.json` implies for checkpoint `path`, if any.
fn config_tie(path: &Path, ck: &Checkpoint, given: &[Vec<String>]) -> Result<Option<Vec<String>>> {
    let dir = if path.is_dir() {
        path
    } else {
        path.parent().unwrap_or(Path::new("."))
    };
    let cfg_path = dir.join("config.json");
    if !cfg_path.exists() {
        return Ok(None);
    }
    let text = crate::util::read_regular(&cfg_path, "model config")?;
    let cfg: serde_json::Value = serde_json::from_slice(&text).map_err(|e| {
        Error::new(
            ErrorKind::InvalidArgument,
            format!("{}: not a JSON model config: {e}", cfg_path.display()),
        )
    })?;
    let tie = cfg
        .get("tie_word_embeddings")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(true);
    let lm_head = cfg
        .get("architectures")
        .and_then(serde_json::Value::as_array)
        .is_some_and(|a| {
            a.iter().filter_map(serde_json::Value::as_str).any(|n| {
                n.ends_with("ForCausalLM")
                    || n.ends_with("LMHeadModel")
                    || n.ends_with("ForConditionalGeneration")
            })
        });
    const OUT: &str = "lm_head.weight";
    if !tie || !lm_head || given.iter().flatten().any(|n| n == OUT) {
        return Ok(None);
    }
    let metas: HashMap<&str, &accel_api::TensorMeta> = ck.iter().collect();
    let input = metas
        .keys()
        .filter(|n| {
            INPUT_EMBEDDINGS
                .iter()
                .any(|s| **n == *s || n.ends_with(&format!(".{s}")))
        })
        .min_by_key(|n| (n.len(), **n));
    let Some(&input) = input else {
        return Ok(None);
    };
    if given.iter().flatten().any(|n| n == input) {
        return Ok(None);
    }
    if let Some(out) = metas.get(OUT) {
        if out.numel() != metas[input].numel() {
            return Ok(None);
        }
    }
    Ok(Some(vec![input.to_string(), OUT.to_string()]))
}
