//! The figures of `accel estimate-memory`: model size, largest layer and
//! an Adam training estimate per dtype; and, under a parallelism
//! configuration, each rank's share of the parameters, gradients and
//! optimizer state ([`per_rank`]).

use accel_api::{DType, Result};

use crate::layout::{Layout, NodeKind};
use crate::plan::{compute_sizes, PlanOptions};

/// One row of the estimate.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Estimate {
    /// The dtype floating-point tensors are counted in.
    pub dtype: String,
    /// Bytes of the largest layer.
    pub largest_layer: u64,
    /// Its name(s).
    pub largest_layer_names: Vec<String>,
    /// Bytes of the whole model.
    pub total: u64,
    /// Adam training estimate in bytes (`None` for integer dtypes).
    pub adam_training: Option<u64>,
    /// What `accelerate estimate-memory` shows in its "Training using Adam"
    /// column for this dtype (`None` where it shows N/A), for comparison:
    /// the largest single part (weights, gradients, optimizer states or
    /// step) rather than their sum, so 8 bytes per parameter for f16/bf16
    /// against 16 for f32.
    pub adam_training_accelerate: Option<u64>,
}

/// Compute the estimate rows.
///
/// Floating-point tensors are counted at the dtype's size (i4 = half a
/// byte), integer tensors at their own. Adam training = weights + gradients
/// in the dtype + two f32 moments (8 bytes/param) + an f32 master copy for
/// half dtypes, i.e. 16 bytes per parameter for f32 and for f16/bf16 mixed
/// precision (the ZeRO paper's 16 bytes per parameter); activations are not
/// included.
///
/// This deliberately differs from `accelerate estimate-memory` for f16 and
/// bf16: Accelerate reports the largest of its four parts (model 4, gradients
/// 6, optimizer 8, step 8 bytes per parameter), 8 bytes per parameter, half
/// its f32 figure, although the weights, gradients and moments all live at
/// once during the optimizer step. Its figure is kept in
/// [`Estimate::adam_training_accelerate`] for comparison.
pub fn estimate(layout: &Layout, no_split: &[String], dtypes: &[String]) -> Result<Vec<Estimate>> {
    let s = compute_sizes(
        layout,
        &PlanOptions {
            no_split: no_split.to_vec(),
            ..Default::default()
        },
    );
    let mut rows = vec![];
    for name in dtypes {
        let (label, num, den, train): (String, u64, u64, Option<u64>) =
            match name.trim().to_ascii_lowercase().as_str() {
                "i4" | "int4" => ("i4".into(), 1, 2, None),
                other => {
                    let d: DType = other.parse()?;
                    let train = match d {
                        DType::F32 | DType::F64 => Some(2 * d.size() as u64 + 8),
                        DType::F16 | DType::BF16 => Some(2 * d.size() as u64 + 8 + 4),
                        _ => None,
                    };
                    (d.name().into(), d.size() as u64, 1, train)
                }
            };
        // Per-tensor bytes in this dtype, then prefix sums over preorder.
        let mut prefix = vec![0u64; layout.len() + 1];
        let mut float_params = 0u64;
        let mut f32_bytes = 0u64;
        for (i, n) in layout.nodes().enumerate() {
            // A tied group counts once, on its first member (as the planner).
            let counted = n.is_tensor() && s.owned[i];
            // The layout checked that every tensor's bytes fit in 64 bits.
            let bytes = n.bytes().unwrap_or(0);
            let b = match n.dtype() {
                Some(d) if counted && d.is_float() => {
                    let numel = bytes / d.size() as u64;
                    float_params += numel;
                    f32_bytes = f32_bytes.saturating_add(numel.saturating_mul(4));
                    numel.saturating_mul(num).div_ceil(den)
                }
                Some(_) if counted => {
                    f32_bytes = f32_bytes.saturating_add(bytes);
                    bytes
                }
                _ => 0,
            };
            prefix[i + 1] = prefix[i].saturating_add(b);
        }
        let accelerate = match label.as_str() {
            "f32" => Some(4 * f32_bytes),
            "f16" | "bf16" => Some(2 * f32_bytes),
            _ => None,
        };
        let size = |id: u32| prefix[layout.node(id).end() as usize] - prefix[id as usize];
        let max = s.layers.iter().map(|&l| size(l)).max().unwrap_or(0);
        let names = s
            .layers
            .iter()
            .filter(|&&l| size(l) == max)
            .map(|&l| layout.node(l).name().to_string())
            .collect();
        let total = prefix[layout.len()];
        rows.push(Estimate {
            dtype: label,
            largest_layer: max,
            largest_layer_names: names,
            total,
            adam_training: train.map(|per| {
                float_params
                    .saturating_mul(per)
                    .saturating_add(total - (float_params * num).div_ceil(den))
            }),
            adam_training_accelerate: accelerate,
        });
    }
    Ok(rows)
}

/// The mesh sizes a per-rank estimate divides by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Split {
    /// Replicas (nothing divided).
    pub dp_replicate: usize,
    /// Ranks parameters, gradients and optimizer state are sharded over
    /// (ZeRO-3 / FSDP).
    pub dp_shard: usize,
    /// Tensor-parallel ranks: matrices divided, vectors replicated.
    pub tp: usize,
}

/// One rank's training memory for one dtype (activations not included).
#[derive(Debug, Clone, serde::Serialize)]
pub struct RankEstimate {
    /// The dtype floating-point tensors are counted in.
    pub dtype: String,
    /// The sizes divided by.
    pub split: Split,
    /// Bytes of this rank's parameters (and buffers).
    pub parameters: u64,
    /// Bytes of its gradients.
    pub gradients: u64,
    /// Bytes of its Adam state: two f32 moments, and an f32 master copy for
    /// f16/bf16.
    pub optimizer: u64,
    /// The sum.
    pub total: u64,
    /// Matrices (2 or more dimensions) that `tp` does not divide: kept
    /// whole on every tensor-parallel rank.
    pub tp_indivisible: Vec<String>,
}

/// Each rank's parameters, gradients and Adam state under `split`, per
/// floating-point dtype in `dtypes`: tensor parallelism divides each
/// parameter of 2 or more dimensions by `tp` along its first dimension
/// that `tp` divides (a column- or row-parallel linear, a vocab-parallel
/// embedding: transformers' `tp_plan` styles) and replicates vectors
/// (norms, biases); then ZeRO-3 / FSDP over `dp_shard` divides everything a
/// rank holds (rounded up). Buffers and integer tensors are replicated and
/// count as parameters only.
///
/// # Errors
/// An unknown dtype name; an integer dtype (training needs a floating one);
/// a size of 0.
pub fn per_rank(layout: &Layout, dtypes: &[String], split: Split) -> Result<Vec<RankEstimate>> {
    if split.dp_replicate == 0 || split.dp_shard == 0 || split.tp == 0 {
        return Err(accel_api::Error::invalid_argument(
            "estimate-memory",
            format!("parallelism sizes must be at least 1, got {split:?}"),
        ));
    }
    let s = compute_sizes(layout, &PlanOptions::default());
    // Elements this rank holds of the trained (float) parameters, and the
    // bytes of everything else it holds whole.
    let (mut params, mut fixed) = (0u64, 0u64);
    let mut indivisible = Vec::new();
    for (i, n) in layout.nodes().enumerate() {
        if !n.is_tensor() || !s.owned[i] {
            continue;
        }
        let bytes = n.bytes().unwrap_or(0);
        match n.dtype() {
            Some(d) if d.is_float() && n.kind() == NodeKind::Param => {
                let numel = bytes / d.size() as u64;
                let shape = n.shape().unwrap_or(&[]);
                let share = if split.tp > 1 && shape.len() >= 2 {
                    if shape.iter().any(|&dim| dim % split.tp == 0) {
                        numel / split.tp as u64
                    } else {
                        indivisible.push(n.name().to_string());
                        numel
                    }
                } else {
                    numel
                };
                params += share;
            }
            _ => fixed += bytes,
        }
    }
    let mine = params.div_ceil(split.dp_shard as u64);
    let fixed = fixed.div_ceil(split.dp_shard as u64);
    let mut rows = Vec::new();
    for name in dtypes {
        let d: DType = name.trim().to_ascii_lowercase().parse()?;
        let master = match d {
            DType::F32 | DType::F64 => 0,
            DType::F16 | DType::BF16 => 4,
            _ => {
                return Err(accel_api::Error::invalid_argument(
                    "estimate-memory",
                    format!(
                        "--parallelism estimates training, which needs a floating dtype, not {}",
                        d.name()
                    ),
                ))
            }
        };
        let parameters = mine * d.size() as u64 + fixed;
        let gradients = mine * d.size() as u64;
        let optimizer = mine * (8 + master);
        rows.push(RankEstimate {
            dtype: d.name().to_string(),
            split,
            parameters,
            gradients,
            optimizer,
            total: parameters + gradients + optimizer,
            tp_indivisible: indivisible.clone(),
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_rank_shares_divide_matrices_by_tp_and_everything_by_dp_shard() {
        let layout = crate::synth::llama_layout(crate::synth::LlamaShape::tiny(2, 0), DType::F32);
        let f32s = ["f32".to_string()];
        let one = Split {
            dp_replicate: 1,
            dp_shard: 1,
            tp: 1,
        };
        let whole = &per_rank(&layout, &f32s, one).unwrap()[0];
        // One rank holds everything: 16 bytes per parameter, as estimate().
        let rows = estimate(&layout, &[], &f32s).unwrap();
        assert_eq!(Some(whole.total), rows[0].adam_training);
        assert_eq!(whole.parameters, rows[0].total);
        let vectors: u64 = layout
            .nodes()
            .filter(|n| n.is_tensor() && n.shape().is_some_and(|s| s.len() < 2))
            .map(|n| n.bytes().unwrap_or(0))
            .sum();
        let tp2 = &per_rank(&layout, &f32s, Split { tp: 2, ..one }).unwrap()[0];
        assert!(tp2.tp_indivisible.is_empty(), "{:?}", tp2.tp_indivisible);
        assert_eq!(tp2.parameters, (whole.parameters - vectors) / 2 + vectors);
        let fsdp2_tp2 = &per_rank(
            &layout,
            &f32s,
            Split {
                dp_shard: 2,
                tp: 2,
                ..one
            },
        )
        .unwrap()[0];
        assert_eq!(fsdp2_tp2.gradients, tp2.gradients.div_ceil(2));
        // Replicas divide nothing.
        let hsdp = &per_rank(
            &layout,
            &f32s,
            Split {
                dp_replicate: 2,
                ..one
            },
        )
        .unwrap()[0];
        assert_eq!(hsdp.total, whole.total);
        // bf16: 2 + 2 + 12 bytes per parameter.
        let bf16 = &per_rank(&layout, &["bf16".into()], one).unwrap()[0];
        assert_eq!(bf16.total, whole.total);
        assert!(per_rank(&layout, &["i8".into()], one).is_err());
        assert!(per_rank(&layout, &f32s, Split { tp: 0, ..one }).is_err());
    }

    #[test]
    fn adam_estimate_for_half_dtypes_and_accelerates_figure() {
        let layout = crate::synth::llama_layout(crate::synth::LlamaShape::tiny(2, 0), DType::F32);
        let rows = estimate(
            &layout,
            &[],
            &["f32".into(), "f16".into(), "bf16".into(), "i8".into()],
        )
        .unwrap();
        let params = rows[0].total / 4;
        // 16 bytes per parameter for f32 and for mixed precision alike.
        assert_eq!(rows[0].adam_training, Some(16 * params));
        assert_eq!(rows[1].adam_training, Some(16 * params));
        assert_eq!(rows[2].adam_training, Some(16 * params));
        // Accelerate's column: the largest part, 16 vs 8 bytes per parameter.
        assert_eq!(rows[0].adam_training_accelerate, Some(16 * params));
        assert_eq!(rows[1].adam_training_accelerate, Some(8 * params));
        assert_eq!(rows[3].adam_training_accelerate, None);
    }
}
