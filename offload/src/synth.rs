//! Synthetic layouts and checkpoints for tests and benchmarks.

use std::path::Path;

use accel_api::{DType, Result, TensorMeta};

use crate::layout::{Layout, LayoutJson, ModuleJson, TensorJson, LAYOUT_FORMAT};
use crate::util::checksum;

fn lin(name: &str, out: usize, inp: usize, dtype: DType) -> ModuleJson {
    ModuleJson {
        name: name.into(),
        class: Some("Linear".into()),
        params: vec![TensorJson {
            name: "weight".into(),
            dtype,
            shape: vec![out, inp],
            persistent: true,
        }],
        ..Default::default()
    }
}

fn norm(name: &str, h: usize, dtype: DType) -> ModuleJson {
    ModuleJson {
        name: name.into(),
        class: Some("RMSNorm".into()),
        params: vec![TensorJson {
            name: "weight".into(),
            dtype,
            shape: vec![h],
            persistent: true,
        }],
        ..Default::default()
    }
}

/// Shape of a Llama-style decoder.
#[derive(Debug, Clone, Copy)]
pub struct LlamaShape {
    /// Hidden size.
    pub hidden: usize,
    /// MLP inner size.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Experts per layer (0 = dense MLP).
    pub experts: usize,
    /// Tie `lm_head.weight` to `model.embed_tokens.weight`.
    pub tied: bool,
}

impl LlamaShape {
    /// Llama-3-70B (80 layers, 8192 hidden, 128256 vocab): 723 tensors.
    pub const LLAMA_70B: LlamaShape = LlamaShape {
        hidden: 8192,
        intermediate: 28672,
        layers: 80,
        heads: 64,
        kv_heads: 8,
        vocab: 128256,
        experts: 0,
        tied: false,
    };

    /// A mixture-of-experts layout with 173k tensors (60 layers × 960
    /// experts × 3 matrices), the size at which Accelerate was reported to
    /// need a minute.
    pub const MOE_173K: LlamaShape = LlamaShape {
        hidden: 2048,
        intermediate: 512,
        layers: 60,
        heads: 16,
        kv_heads: 4,
        vocab: 102400,
        experts: 960,
        tied: false,
    };

    /// A tiny model for tests.
    pub fn tiny(layers: usize, experts: usize) -> LlamaShape {
        LlamaShape {
            hidden: 16,
            intermediate: 32,
            layers,
            heads: 4,
            kv_heads: 2,
            vocab: 64,
            experts,
            tied: true,
        }
    }
}

/// A Llama-shaped layout (`LlamaForCausalLM` module names and classes).
pub fn llama_layout(s: LlamaShape, dtype: DType) -> Layout {
    let h = s.hidden;
    let hd = h / s.heads;
    let layers = (0..s.layers)
        .map(|i| {
            let attn = ModuleJson {
                name: "self_attn".into(),
                class: Some("LlamaAttention".into()),
                children: vec![
                    lin("q_proj", h, h, dtype),
                    lin("k_proj", s.kv_heads * hd, h, dtype),
                    lin("v_proj", s.kv_heads * hd, h, dtype),
                    lin("o_proj", h, h, dtype),
                ],
                ..Default::default()
            };
            let mlp = if s.experts == 0 {
                ModuleJson {
                    name: "mlp".into(),
                    class: Some("LlamaMLP".into()),
                    children: vec![
                        lin("gate_proj", s.intermediate, h, dtype),
                        lin("up_proj", s.intermediate, h, dtype),
                        lin("down_proj", h, s.intermediate, dtype),
                    ],
                    ..Default::default()
                }
            } else {
                let experts = (0..s.experts)
                    .map(|e| ModuleJson {
                        name: e.to_string(),
                        class: Some("Expert".into()),
                        children: vec![
                            lin("w1", s.intermediate, h, dtype),
                            lin("w2", h, s.intermediate, dtype),
                            lin("w3", s.intermediate, h, dtype),
                        ],
                        ..Default::default()
                    })
                    .collect();
                ModuleJson {
                    name: "mlp".into(),
                    class: Some("SparseMoeBlock".into()),
                    children: vec![
                        lin("gate", s.experts, h, dtype),
                        ModuleJson {
                            name: "experts".into(),
                            class: Some("ModuleList".into()),
                            children: experts,
                            ..Default::default()
                        },
                    ],
                    ..Default::default()
                }
            };
            ModuleJson {
                name: i.to_string(),
                class: Some("LlamaDecoderLayer".into()),
                children: vec![
                    attn,
                    mlp,
                    norm("input_layernorm", h, dtype),
                    norm("post_attention_layernorm", h, dtype),
                ],
                ..Default::default()
            }
        })
        .collect();
    let model = ModuleJson {
        name: "model".into(),
        class: Some("LlamaModel".into()),
        children: vec![
            ModuleJson {
                name: "embed_tokens".into(),
                class: Some("Embedding".into()),
                params: vec![TensorJson {
                    name: "weight".into(),
                    dtype,
                    shape: vec![s.vocab, h],
                    persistent: true,
                }],
                ..Default::default()
            },
            ModuleJson {
                name: "layers".into(),
                class: Some("ModuleList".into()),
                children: layers,
                ..Default::default()
            },
            norm("norm", h, dtype),
        ],
        ..Default::default()
    };
    let root = ModuleJson {
        name: String::new(),
        class: Some("LlamaForCausalLM".into()),
        children: vec![model, lin("lm_head", s.vocab, h, dtype)],
        ..Default::default()
    };
    let tied = if s.tied {
        vec![vec![
            "model.embed_tokens.weight".into(),
            "lm_head.weight".into(),
        ]]
    } else {
        vec![]
    };
    Layout::from_json(&LayoutJson {
        format: LAYOUT_FORMAT.into(),
        root,
        tied,
    })
    .expect("synthetic layout")
}

/// Deterministic pseudo-random bytes for tensor `name`.
pub fn tensor_bytes(name: &str, len: usize) -> Vec<u8> {
    let mut x = checksum(name.as_bytes()) | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Write `layout`'s owned, persistent tensors as a sharded checkpoint in `dir` (shards
/// of about `shard_bytes`), with deterministic contents; returns
/// (name, checksum) of every tensor written.
pub fn write_checkpoint(
    layout: &Layout,
    dir: &Path,
    shard_bytes: u64,
) -> Result<Vec<(String, u64)>> {
    let mut names = vec![];
    let mut metas: Vec<TensorMeta> = vec![];
    let mut datas = vec![];
    for id in layout.tensor_ids() {
        let n = layout.node(id);
        if n.alias_of().is_some() || !n.persistent() {
            continue;
        }
        let m = n.meta().expect("tensor");
        datas.push(tensor_bytes(n.name(), m.byte_len()));
        names.push(n.name().to_string());
        metas.push(m);
    }
    let ts: Vec<(&str, &TensorMeta, &[u8])> = names
        .iter()
        .zip(&metas)
        .zip(&datas)
        .map(|((n, m), d)| (n.as_str(), m, &d[..]))
        .collect();
    crate::safetensors::write_sharded(dir, &ts, shard_bytes)?;
    Ok(names
        .iter()
        .zip(&datas)
        .map(|(n, d)| (n.clone(), checksum(d)))
        .collect())
}
