//! The logic of `accel plan` and `accel estimate-memory`, kept here so the
//! launcher only has to forward its arguments (see the crate docs).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use accel_api::{DType, Error, ErrorKind, Result};

use crate::layout::Layout;
use crate::plan::{
    compute_sizes, plan as make_plan, MaxMemory, Plan, PlanOptions, Reserve, Strategy,
};
use crate::safetensors::Checkpoint;
use crate::util::format_bytes;

/// Where the model layout comes from.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// A safetensors checkpoint: a directory (with model.safetensors.index.json,
    /// model.safetensors or *.safetensors), a .safetensors file or an index file.
    #[arg(
        long,
        value_name = "DIR|FILE",
        required_unless_present = "layout",
        conflicts_with = "layout"
    )]
    pub checkpoint: Option<PathBuf>,
    /// A layout JSON file (accel-layout/1, e.g. from tools/export_layout.py).
    #[arg(long, value_name = "FILE")]
    pub layout: Option<PathBuf>,
    /// Tensors sharing storage, comma-separated; repeat for more groups
    /// (checkpoints store tied weights once, so their headers cannot tell).
    #[arg(long = "tied", value_name = "A,B[,..]")]
    pub tied: Vec<String>,
    /// Modules that must stay on one device: class names or full-name globs
    /// (`model.layers.*`); comma-separated or repeated.
    #[arg(long = "no-split", value_name = "CLASS|PATTERN", value_delimiter = ',')]
    pub no_split: Vec<String>,
}

impl ModelArgs {
    /// Read the layout.
    pub fn load(&self) -> Result<Layout> {
        let tied: Vec<Vec<String>> = self
            .tied
            .iter()
            .map(|g| g.split(',').map(|s| s.trim().to_string()).collect())
            .collect();
        match (&self.checkpoint, &self.layout) {
            (Some(c), None) => Layout::from_checkpoint(&Checkpoint::open(c)?, &tied),
            (None, Some(l)) => {
                let layout = Layout::from_json_file(l)?;
                if tied.is_empty() {
                    Ok(layout)
                } else {
                    let mut doc = layout.to_json();
                    doc.tied.extend(tied);
                    Layout::from_json(&doc)
                }
            }
            _ => Err(Error::new(
                ErrorKind::InvalidConfig,
                "give exactly one of --checkpoint and --layout",
            )),
        }
    }
}

/// `accel plan`: a device map for a model under memory budgets.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub model: ModelArgs,
    /// Budgets in fill order, e.g. `cuda:0=40GiB,cuda:1=40GiB,cpu=200GiB,disk`
    /// (GiB GB MiB MB KiB KB bytes; `disk` without a size is unbounded).
    #[arg(long, value_name = "SPEC")]
    pub max_memory: String,
    /// Load floating-point tensors as this dtype (f16, bf16, f32, ...).
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<DType>,
    /// Per-tensor dtype, `name=dtype`; repeatable.
    #[arg(long = "tensor-dtype", value_name = "NAME=DTYPE")]
    pub tensor_dtype: Vec<String>,
    /// How accelerator budgets are derived.
    #[arg(long, value_enum, default_value_t = Strategy::Sequential)]
    pub strategy: Strategy,
    /// Where the largest layer's size is kept free.
    #[arg(long, value_enum, default_value_t = Reserve::MainDevices)]
    pub reserve: Reserve,
    /// Print one JSON document (devices and map) instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also write the device map JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// Build the planner options from `args`.
pub fn plan_options(args: &PlanArgs) -> Result<PlanOptions> {
    let mut special = HashMap::new();
    for item in &args.tensor_dtype {
        let (n, d) = item
            .split_once('=')
            .ok_or_else(|| Error::invalid_config("--tensor-dtype", item, "expected NAME=DTYPE"))?;
        special.insert(n.trim().to_string(), d.parse::<DType>()?);
    }
    Ok(PlanOptions {
        max_memory: Some(MaxMemory::parse(&args.max_memory)?),
        no_split: args.model.no_split.clone(),
        dtype: args.dtype,
        special_dtypes: special,
        strategy: args.strategy,
        reserve: args.reserve,
    })
}

/// The JSON document `accel plan --json` prints.
pub fn plan_json(layout: &Layout, p: &Plan, millis: f64) -> serde_json::Value {
    serde_json::json!({
        "tensors": layout.tensor_count(),
        "planning_ms": millis,
        "devices": p.devices,
        "device_map": p.map_json(),
    })
}

/// Run `accel plan`; returns what to print on stdout.
pub fn plan(args: &PlanArgs) -> Result<String> {
    let layout = args.model.load()?;
    let opts = plan_options(args)?;
    let t = Instant::now();
    let p = make_plan(&layout, &opts)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let doc = plan_json(&layout, &p, ms);
    if let Some(out) = &args.output {
        crate::util::atomic_write(out, |w| {
            serde_json::to_writer_pretty(w, &p.map_json()).map_err(std::io::Error::other)
        })?;
    }
    if args.json {
        return Ok(format!(
            "{}\n",
            serde_json::to_string_pretty(&doc).expect("json")
        ));
    }
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<10} {:>12} {:>12} {:>12} {:>7} {:>8} {:>8}",
        "device", "budget", "used", "reserved", "share", "tensors", "entries"
    );
    for d in &p.devices {
        let budget = d.budget.map_or("unbounded".to_string(), format_bytes);
        let share = d.budget.filter(|&b| b > 0).map_or("-".to_string(), |b| {
            format!("{:.1}%", 100.0 * d.used as f64 / b as f64)
        });
        let _ = writeln!(
            s,
            "{:<10} {:>12} {:>12} {:>12} {:>7} {:>8} {:>8}",
            d.device.to_string(),
            budget,
            format_bytes(d.used),
            format_bytes(d.reserved),
            share,
            d.tensors,
            d.entries
        );
    }
    let total: u64 = p.devices.iter().map(|d| d.used).sum();
    let _ = writeln!(
        s,
        "{} tensors, {} placed, planned in {ms:.2} ms",
        layout.tensor_count(),
        format_bytes(total)
    );
    let _ = writeln!(s, "device map:");
    let _ = writeln!(
        s,
        "{}",
        serde_json::to_string_pretty(&p.map_json()).expect("json")
    );
    Ok(s)
}

/// `accel estimate-memory`: model size, largest layer and an Adam training
/// estimate per dtype.
#[derive(Debug, Clone, clap::Args)]
pub struct EstimateArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub model: ModelArgs,
    /// Dtypes to estimate: f32, f16, bf16, i8, i4 (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "f32,f16,i8,i4")]
    pub dtypes: Vec<String>,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

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
}

/// Compute the estimate rows.
///
/// Floating-point tensors are counted at the dtype's size (i4 = half a
/// byte), integer tensors at their own. Adam training = weights + gradients
/// in the dtype + two f32 moments (8 bytes/param) + an f32 master copy for
/// half dtypes, i.e. 16 bytes per parameter for f32 and for f16/bf16 mixed
/// precision; activations are not included.
pub fn estimate(layout: &Layout, no_split: &[String], dtypes: &[String]) -> Result<Vec<Estimate>> {
    let s = compute_sizes(
        layout,
        &PlanOptions {
            no_split: no_split.to_vec(),
            ..Default::default()
        },
    );
    let nodes = layout.nodes();
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
        let mut prefix = vec![0u64; nodes.len() + 1];
        let mut float_params = 0u64;
        for (i, n) in nodes.iter().enumerate() {
            let b = match (&n.meta, n.alias_of) {
                (Some(m), None) if m.dtype.is_float() => {
                    float_params += m.numel() as u64;
                    (m.numel() as u64 * num).div_ceil(den)
                }
                (Some(m), None) => m.byte_len() as u64,
                _ => 0,
            };
            prefix[i + 1] = prefix[i] + b;
        }
        let size = |id: u32| prefix[nodes[id as usize].end as usize] - prefix[id as usize];
        let max = s.layers.iter().map(|&l| size(l)).max().unwrap_or(0);
        let names = s
            .layers
            .iter()
            .filter(|&&l| size(l) == max)
            .map(|&l| nodes[l as usize].name.clone())
            .collect();
        let total = prefix[nodes.len()];
        rows.push(Estimate {
            dtype: label,
            largest_layer: max,
            largest_layer_names: names,
            total,
            adam_training: train
                .map(|per| float_params * per + (total - (float_params * num).div_ceil(den))),
        });
    }
    Ok(rows)
}

/// Run `accel estimate-memory`; returns what to print on stdout.
pub fn estimate_memory(args: &EstimateArgs) -> Result<String> {
    let layout = args.model.load()?;
    let rows = estimate(&layout, &args.model.no_split, &args.dtypes)?;
    if args.json {
        return Ok(format!(
            "{}\n",
            serde_json::to_string_pretty(&rows).expect("json")
        ));
    }
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<6} {:>14} {:>14} {:>22}",
        "dtype", "largest layer", "total size", "training using Adam"
    );
    for r in &rows {
        let _ = writeln!(
            s,
            "{:<6} {:>14} {:>14} {:>22}",
            r.dtype,
            format_bytes(r.largest_layer),
            format_bytes(r.total),
            r.adam_training.map_or("-".into(), format_bytes)
        );
    }
    if let Some(r) = rows.first() {
        let _ = writeln!(s, "largest layer: {}", r.largest_layer_names.join(", "));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    enum Cmd {
        Plan(PlanArgs),
        EstimateMemory(EstimateArgs),
    }

    #[test]
    fn plan_and_estimate_from_a_checkpoint() {
        let layout = crate::synth::llama_layout(crate::synth::LlamaShape::tiny(4, 0), DType::F32);
        let d = tempfile::tempdir().unwrap();
        crate::synth::write_checkpoint(&layout, d.path(), 8 << 10).unwrap();
        let dir = d.path().to_str().unwrap();
        let out_file = d.path().join("map.json");
        let Cmd::Plan(a) = Cmd::parse_from([
            "x",
            "plan",
            "--checkpoint",
            dir,
            "--max-memory",
            "cuda:0=20KiB,cpu=20KiB,disk",
            "--no-split",
            "model.layers.*",
            "--tied",
            "model.embed_tokens.weight,lm_head.weight",
            "--output",
            out_file.to_str().unwrap(),
        ]) else {
            panic!()
        };
        let text = plan(&a).unwrap();
        assert!(
            text.contains("cuda:0") && text.contains("disk") && text.contains("device map:"),
            "{text}"
        );
        let map: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&out_file).unwrap()).unwrap();
        assert!(!map.as_object().unwrap().is_empty());
        let mut a2 = a.clone();
        a2.json = true;
        let doc: serde_json::Value = serde_json::from_str(&plan(&a2).unwrap()).unwrap();
        assert_eq!(doc["tensors"], layout.tensor_count());
        let mut bad = a.clone();
        bad.max_memory = "cuda:0=forty".into();
        assert_eq!(plan(&bad).unwrap_err().kind(), &ErrorKind::InvalidConfig);

        let Cmd::EstimateMemory(e) =
            Cmd::parse_from(["x", "estimate-memory", "--checkpoint", dir, "--json"])
        else {
            panic!()
        };
        let rows: Vec<serde_json::Value> =
            serde_json::from_str(&estimate_memory(&e).unwrap()).unwrap();
        assert_eq!(rows.len(), 4);
        let f32_total = rows[0]["total"].as_u64().unwrap();
        assert_eq!(rows[1]["total"].as_u64().unwrap() * 2, f32_total);
        assert_eq!(rows[3]["total"].as_u64().unwrap() * 8, f32_total);
        assert_eq!(rows[0]["adam_training"].as_u64().unwrap(), f32_total * 4);
        assert!(rows[2]["adam_training"].is_null());
        assert!(estimate_memory(&EstimateArgs { json: false, ..e })
            .unwrap()
            .contains("training using Adam"));
    }
}
