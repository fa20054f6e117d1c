//! The logic of `accel plan` and `accel estimate-memory`, kept here so the
//! launcher only has to forward its arguments (see the crate docs).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
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
    ///
    /// # Errors
    /// See [`ModelArgs::load_with_notes`].
    pub fn load(&self) -> Result<Layout> {
        self.load_with_notes().map(|(l, _)| l)
    }

    /// Read the layout, with notes for the user on what was inferred: the
    /// module order of a bare checkpoint, and tied weights read from the
    /// `config.json` next to it (`tie_word_embeddings`, true when absent as
    /// in transformers, ties `lm_head.weight` to the input embedding for
    /// models with a language-model head).
    ///
    /// # Errors
    /// Checkpoint and layout errors as they come; [`ErrorKind::InvalidArgument`]
    /// for an unreadable `config.json` or bad tied names.
    pub fn load_with_notes(&self) -> Result<(Layout, Vec<String>)> {
        let mut tied: Vec<Vec<String>> = self
            .tied
            .iter()
            .map(|g| g.split(',').map(|s| s.trim().to_string()).collect())
            .collect();
        let mut notes = vec![];
        match (&self.checkpoint, &self.layout) {
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
    /// When the reservation would leave a device empty, place the first
    /// module further on that fits there (Accelerate's fallback_allocation).
    #[arg(long)]
    pub fallback_allocation: bool,
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
        fallback_allocation: args.fallback_allocation,
    })
}

/// The JSON document `accel plan --json` prints: tensor count, planning
/// time, per-device lines, whether the module order was inferred, notes,
/// and the device map with its keys in module order.
#[derive(Debug, serde::Serialize)]
pub struct PlanDoc<'a> {
    /// Tensors of the layout (aliases included).
    pub tensors: usize,
    /// Time spent planning, in milliseconds.
    pub planning_ms: f64,
    /// `"model"` (given by the model's layout) or `"inferred"` (from
    /// tensor names).
    pub module_order: &'static str,
    /// What was inferred or why a device is empty, in words.
    pub notes: &'a [String],
    /// Per device, in fill order.
    pub devices: &'a [crate::plan::DevicePlan],
    /// The merged map in module order.
    pub device_map: crate::plan::DeviceMap<'a>,
}

/// Build the document `accel plan --json` prints.
pub fn plan_json<'a>(
    layout: &Layout,
    p: &'a Plan,
    millis: f64,
    notes: &'a [String],
) -> PlanDoc<'a> {
    PlanDoc {
        tensors: layout.tensor_count(),
        planning_ms: millis,
        module_order: if layout.order_inferred() {
            "inferred"
        } else {
            "model"
        },
        notes,
        devices: &p.devices,
        device_map: p.device_map(),
    }
}

/// Run `accel plan`; returns what to print on stdout.
pub fn plan(args: &PlanArgs) -> Result<String> {
    let (layout, mut notes) = args.model.load_with_notes()?;
    let opts = plan_options(args)?;
    let t = Instant::now();
    let p = make_plan(&layout, &opts)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if let Some(out) = &args.output {
        crate::util::atomic_write(out, |w| {
            serde_json::to_writer_pretty(w, &p.device_map()).map_err(std::io::Error::other)
        })?;
    }
    if args.json {
        let doc = plan_json(&layout, &p, ms, &notes);
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
    for d in &p.devices {
        if let Some(r) = &d.empty_reason {
            notes.push(format!("{}: {r}", d.device));
        }
    }
    for n in &notes {
        let _ = writeln!(s, "note: {n}");
    }
    let _ = writeln!(s, "device map (module order):");
    let _ = writeln!(
        s,
        "{}",
        serde_json::to_string_pretty(&p.device_map()).expect("json")
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
        let mut f32_bytes = 0u64;
        for (i, n) in nodes.iter().enumerate() {
            // A tied group counts once, on its first member (as the planner).
            let counted = n.is_tensor() && s.owned[i] == 1;
            let b = match &n.meta {
                Some(m) if counted && m.dtype.is_float() => {
                    let numel = m.numel() as u64;
                    float_params += numel;
                    f32_bytes = f32_bytes.saturating_add(numel.saturating_mul(4));
                    numel.saturating_mul(num).div_ceil(den)
                }
                Some(m) if counted => {
                    f32_bytes = f32_bytes.saturating_add(m.byte_len() as u64);
                    m.byte_len() as u64
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
    let _ = writeln!(
        s,
        "Adam: weights + gradients + two f32 moments (+ an f32 master copy for f16/bf16), \
         16 bytes per parameter for f32 and for mixed precision alike; `accelerate \
         estimate-memory` shows its largest single part instead (8 bytes per parameter for f16)"
    );
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
            text.contains("cuda:0") && text.contains("disk") && text.contains("device map"),
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

    fn parse_plan(args: &[&str]) -> PlanArgs {
        let mut v = vec!["x", "plan"];
        v.extend_from_slice(args);
        match Cmd::parse_from(v) {
            Cmd::Plan(a) => a,
            Cmd::EstimateMemory(_) => unreachable!(),
        }
    }

    #[test]
    fn config_json_ties_word_embeddings_and_order_is_reported() {
        let mut shape = crate::synth::LlamaShape::tiny(3, 0);
        shape.tied = true;
        let layout = crate::synth::llama_layout(shape, DType::F32);
        let d = tempfile::tempdir().unwrap();
        crate::synth::write_checkpoint(&layout, d.path(), 1 << 20).unwrap();
        let dir = d.path().to_str().unwrap();
        let total = layout.tensor_count();
        // No config: lm_head is simply absent.
        let a = parse_plan(&["--checkpoint", dir, "--max-memory", "cpu=1GiB", "--json"]);
        let doc: serde_json::Value = serde_json::from_str(&plan(&a).unwrap()).unwrap();
        assert_eq!(doc["tensors"], total - 1);
        assert_eq!(doc["module_order"], "inferred");
        // tie_word_embeddings absent means true (transformers' default).
        let cfg = d.path().join("config.json");
        std::fs::write(&cfg, r#"{"architectures":["LlamaForCausalLM"]}"#).unwrap();
        let text = plan(&a).unwrap();
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(doc["tensors"], total, "{text}");
        assert!(
            text.contains("tied from config.json (tie_word_embeddings): model.embed_tokens.weight = lm_head.weight"),
            "{text}"
        );
        // The map lists modules in order: embeddings first, lm_head last.
        let mut b = a.clone();
        b.max_memory = "cuda:0=16KiB,cpu=1GiB".into();
        b.model.no_split = vec!["LlamaDecoderLayer".into(), "model.layers.*".into()];
        let text = plan(&b).unwrap();
        let pos = |k: &str| text.find(&format!("\"{k}\"")).unwrap_or(usize::MAX);
        let order = [
            "model.embed_tokens",
            "model.layers",
            "model.norm",
            "lm_head",
        ]
        .map(pos);
        assert!(
            order.windows(2).all(|w| w[0] < w[1]) && order[3] < usize::MAX,
            "{text}"
        );
        std::fs::write(
            &cfg,
            r#"{"architectures":["LlamaForCausalLM"],"tie_word_embeddings":false}"#,
        )
        .unwrap();
        let doc: serde_json::Value = serde_json::from_str(&plan(&a).unwrap()).unwrap();
        assert_eq!(doc["tensors"], total - 1);
        // A model without a language-model head ties nothing.
        std::fs::write(&cfg, r#"{"architectures":["BertModel"]}"#).unwrap();
        let doc: serde_json::Value = serde_json::from_str(&plan(&a).unwrap()).unwrap();
        assert_eq!(doc["tensors"], total - 1);
    }

    #[test]
    fn fifo_checkpoint_or_layout_is_refused_not_waited_on() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("model.safetensors");
        let ok = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("skipped: no mkfifo");
            return;
        }
        let dir = d.path().to_path_buf();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let dir = dir.to_str().unwrap().to_string();
            let fifo = format!("{dir}/model.safetensors");
            let r1 = plan(&parse_plan(&[
                "--checkpoint",
                &dir,
                "--max-memory",
                "cpu=1GiB",
            ]));
            let r2 = plan(&parse_plan(&[
                "--layout",
                &fifo,
                "--max-memory",
                "cpu=1GiB",
            ]));
            let _ = tx.send((r1.map(|_| ()), r2.map(|_| ())));
        });
        let (r1, r2) = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("accel plan blocked on a FIFO");
        for r in [r1, r2] {
            let e = r.unwrap_err();
            assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
            assert!(
                e.to_string().contains("FIFO") && e.to_string().contains("not a regular file"),
                "{e}"
            );
        }
    }

    #[test]
    fn huge_layout_tensor_is_an_error_not_four_bytes() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("huge.json");
        std::fs::write(
            &f,
            format!(
                r#"{{"format":"accel-layout/1","root":{{"children":[{{"name":"lin","params":[{{"name":"weight","dtype":"f32","shape":[{}]}}]}}]}}}}"#,
                (1u64 << 62) + 1
            ),
        )
        .unwrap();
        let e = plan(&parse_plan(&[
            "--layout",
            f.to_str().unwrap(),
            "--max-memory",
            "cpu=1GiB",
        ]))
        .unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
        assert!(
            e.to_string().contains("`lin.weight`") && e.to_string().contains("2^64"),
            "{e}"
        );
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
