//! The figures of `accel estimate-memory`: model size, largest layer and
//! an Adam training estimate per dtype.

use accel_api::{DType, Result};

use crate::layout::Layout;
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

#[cfg(test)]
mod tests {
    use super::*;

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
