//! all-MiniLM-L6-v2 with tensor parallelism (issue 39): each rank of the
//! tensor-parallel group holds `12 / tp` attention heads and `1536 / tp`
//! MLP units of every layer, cut from the one-rank checkpoint by
//! accel-candle's layers as the model's tensor-parallel plan ([`TP_PLAN`],
//! transformers' `tp_plan` vocabulary) says: query, key, value and the
//! MLP's first layer `colwise`; the attention's output and the MLP's second
//! layer `rowwise` (two all-reduces per layer). The
//! embeddings, the layer norms and the pooling are replicated. The
//! layers' arithmetic is candle-transformers' BERT's (scaled dot-product
//! attention with the additive mask, exact GELU, post-norm residuals).

use std::path::Path;
use std::sync::Arc;

use accel_api::{Communicator, Error, ErrorKind, Result};
use accel_candle::tp::PlannedLinear;
use accel_candle::tp::TpPlan;
use accel_example_minilm_data::bad_model;
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{LayerNorm, Module, VarBuilder};
use candle_transformers::models::bert::{BertModel, Config};

fn candle(e: candle_core::Error) -> Error {
    Error::new(ErrorKind::Backend, format!("candle: {e}"))
}

/// BERT's tensor-parallel plan (module patterns, `*` one segment): how
/// [`TpMinilm::load`] splits every layer.
pub const TP_PLAN: &str = r#"{
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise"
}"#;

/// One BERT layer, this rank's part of it.
struct Layer {
    query: PlannedLinear,
    key: PlannedLinear,
    value: PlannedLinear,
    attn_out: PlannedLinear,
    attn_norm: LayerNorm,
    up: PlannedLinear,
    down: PlannedLinear,
    out_norm: LayerNorm,
}

/// The model split over a tensor-parallel group.
pub struct TpMinilm {
    embeddings: BertModel,
    layers: Vec<Layer>,
    heads: usize,
    head_size: usize,
    tokenizer: tokenizers::Tokenizer,
}

impl std::fmt::Debug for TpMinilm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpMinilm")
            .field("layers", &self.layers.len())
            .field("heads_per_rank", &self.heads)
            .finish_non_exhaustive()
    }
}

impl TpMinilm {
    /// Load the model in `dir`, this rank's part of every layer for
    /// `group` (its size must divide the 12 heads and the 1,536 MLP
    /// units).
    ///
    /// # Errors
    /// Missing or unreadable files; a group size that does not divide the
    /// heads; candle's.
    pub fn load(dir: &Path, group: Arc<dyn Communicator>) -> Result<TpMinilm> {
        let text = std::fs::read_to_string(dir.join("config.json"))
            .map_err(|e| bad_model(dir, format!("config.json: {e}")))?;
        let cfg: Config =
            serde_json::from_str(&text).map_err(|e| bad_model(dir, format!("config.json: {e}")))?;
        let tp = group.world_size();
        if !cfg.num_attention_heads.is_multiple_of(tp) {
            return Err(Error::invalid_argument(
                "TpMinilm::load",
                format!(
                    "{} attention heads do not split over {tp} ranks",
                    cfg.num_attention_heads
                ),
            ));
        }
        let bytes = std::fs::read(dir.join("model.safetensors"))
            .map_err(|e| bad_model(dir, format!("model.safetensors: {e}")))?;
        let vb = VarBuilder::from_buffered_safetensors(bytes, DType::F32, &Device::Cpu)
            .map_err(candle)?;
        let none = Config {
            num_hidden_layers: 0,
            ..cfg.clone()
        };
        let embeddings = BertModel::load(vb.clone(), &none).map_err(candle)?;
        let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let plan = TpPlan::from_json(TP_PLAN)?;
        let mut layers = Vec::new();
        for i in 0..cfg.num_hidden_layers {
            let l = vb.pp(format!("encoder.layer.{i}"));
            // Module `name` of this layer, `[rows, cols]`, split by the plan.
            let linear = |name: &str, rows: usize, cols: usize| -> Result<PlannedLinear> {
                let p = l.pp(name);
                let weight = p.get((rows, cols), "weight").map_err(candle)?;
                let bias = p.get(rows, "bias").map_err(candle)?;
                let module = format!("encoder.layer.{i}.{name}");
                PlannedLinear::from_full(&module, &weight, Some(&bias), &plan, group.clone())
            };
            let norm = |p: VarBuilder<'_>| {
                candle_nn::layer_norm(h, cfg.layer_norm_eps, p.pp("LayerNorm")).map_err(candle)
            };
            layers.push(Layer {
                query: linear("attention.self.query", h, h)?,
                key: linear("attention.self.key", h, h)?,
                value: linear("attention.self.value", h, h)?,
                attn_out: linear("attention.output.dense", h, h)?,
                attn_norm: norm(l.pp("attention.output"))?,
                up: linear("intermediate.dense", inter, h)?,
                down: linear("output.dense", h, inter)?,
                out_norm: norm(l.pp("output"))?,
            });
        }
        let tokenizer = crate::load_tokenizer(dir)?;
        Ok(TpMinilm {
            embeddings,
            layers,
            heads: cfg.num_attention_heads / tp,
            head_size: h / cfg.num_attention_heads,
            tokenizer,
        })
    }

    /// Unit-length embeddings of `sentences`, as rows (the same on every
    /// rank). Collective over the group.
    ///
    /// # Errors
    /// No sentence, or one the tokenizer rejects; candle's; the
    /// collectives'.
    pub fn embed(&self, sentences: &[&str]) -> Result<Vec<Vec<f32>>> {
        let crate::Batch {
            ids,
            type_ids,
            mask,
            extended,
        } = crate::tokenize(&self.tokenizer, sentences, "TpMinilm::embed")?;
        let mut h = self
            .embeddings
            .forward(&ids, &type_ids, Some(&mask))
            .map_err(candle)?;
        for l in &self.layers {
            h = self.layer(l, &h, &extended)?;
        }
        crate::mean_pool_normalize(&h, &mask)
            .and_then(|e| e.to_vec2::<f32>())
            .map_err(candle)
    }

    fn layer(&self, l: &Layer, h: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let heads = |x: Tensor| -> candle_core::Result<Tensor> {
            let (b, t, _) = x.dims3()?;
            x.reshape((b, t, self.heads, self.head_size))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = heads(l.query.forward(h)?).map_err(candle)?;
        let k = heads(l.key.forward(h)?).map_err(candle)?;
        let v = heads(l.value.forward(h)?).map_err(candle)?;
        let context = (|| -> candle_core::Result<Tensor> {
            let scores = q.matmul(&k.t()?)?;
            let scores = (scores / (self.head_size as f64).sqrt())?.broadcast_add(mask)?;
            let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
            probs
                .matmul(&v)?
                .transpose(1, 2)?
                .contiguous()?
                .flatten_from(D::Minus2)
        })()
        .map_err(candle)?;
        let attn = l.attn_out.forward(&context)?;
        let attn = l
            .attn_norm
            .forward(&(attn + h).map_err(candle)?)
            .map_err(candle)?;
        let up = l.up.forward(&attn)?.gelu_erf().map_err(candle)?;
        let down = l.down.forward(&up)?;
        l.out_norm
            .forward(&(down + &attn).map_err(candle)?)
            .map_err(candle)
    }
}
