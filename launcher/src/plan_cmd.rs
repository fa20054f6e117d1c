//! `accel plan` and `accel estimate-memory`: the command line over
//! accel-offload's planner (the library has no CLI dependencies).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use accel_api::{DType, Error, Result};
use accel_offload::estimate::{estimate, per_rank, RankEstimate, Split};
use accel_offload::layout::Layout;
use accel_offload::plan::{plan as make_plan, MaxMemory, Plan, PlanOptions, Reserve, Strategy};
use accel_offload::source;
use accel_offload::util::format_bytes;

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
    /// Read the layout, with notes for the user on what was inferred
    /// ([`source::load_layout`]).
    ///
    /// # Errors
    /// As [`source::load_layout`].
    pub fn load_with_notes(&self) -> Result<(Layout, Vec<String>)> {
        source::load_layout(
            self.checkpoint.as_deref(),
            self.layout.as_deref(),
            &self.tied,
        )
    }
}

/// `--strategy`: [`Strategy`]'s values on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StrategyArg {
    /// Fill devices in order (`device_map="sequential"` / `"auto"`).
    Sequential,
    /// Even share per accelerator (`"balanced"`).
    Balanced,
    /// Even share, keeping the first accelerator as empty as possible
    /// (`"balanced_low_0"`, for generation outputs).
    #[value(name = "balanced-low-0", alias = "balanced_low_0")]
    BalancedLow0,
}

impl From<StrategyArg> for Strategy {
    fn from(s: StrategyArg) -> Strategy {
        match s {
            StrategyArg::Sequential => Strategy::Sequential,
            StrategyArg::Balanced => Strategy::Balanced,
            StrategyArg::BalancedLow0 => Strategy::BalancedLow0,
        }
    }
}

/// `--reserve`: [`Reserve`]'s values on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReserveArg {
    /// The first accelerator and cpu (Accelerate's `main_devices`).
    MainDevices,
    /// Every accelerator and cpu.
    EveryAccelerator,
    /// Nowhere (no offload expected).
    None,
}

impl From<ReserveArg> for Reserve {
    fn from(r: ReserveArg) -> Reserve {
        match r {
            ReserveArg::MainDevices => Reserve::MainDevices,
            ReserveArg::EveryAccelerator => Reserve::EveryAccelerator,
            ReserveArg::None => Reserve::None,
        }
    }
}

/// `accel plan`: a device map for a model under memory budgets.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    #[command(flatten)]
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
    #[arg(long, value_enum, default_value_t = StrategyArg::Sequential)]
    pub strategy: StrategyArg,
    /// Where the largest layer's size is kept free.
    #[arg(long, value_enum, default_value_t = ReserveArg::MainDevices)]
    pub reserve: ReserveArg,
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
        strategy: args.strategy.into(),
        reserve: args.reserve.into(),
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
    pub devices: &'a [accel_offload::plan::DevicePlan],
    /// The merged map in module order.
    pub device_map: accel_offload::plan::DeviceMap<'a>,
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
        accel_api::durable::write_atomic(out, |w| {
            serde_json::to_writer_pretty(w, &p.device_map()).map_err(std::io::Error::other)
        })?;
    }
    if args.json {
        return Ok(pretty_json(&plan_json(&layout, &p, ms, &notes)));
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
    pub model: ModelArgs,
    /// Dtypes to estimate: f32, f16, bf16, i8, i4 (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "f32,f16,i8,i4")]
    pub dtypes: Vec<String>,
    /// Each rank's share under a parallelism configuration, as
    /// `dp_shard=2,tp=2` (sizes dp_replicate, dp_shard, tp, cp; unset ones
    /// 1; checked as accel launch checks them).
    #[arg(long, value_name = "DIM=N,..", value_parser = parse_parallelism)]
    pub parallelism: Option<Split>,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// `dp_shard=2,tp=2` into the sizes, checked by Accelerate's rules
/// (`accel::mesh::ParallelismConfig::for_world` of their product).
fn parse_parallelism(s: &str) -> std::result::Result<Split, String> {
    let mut c = accel::mesh::ParallelismConfig::default();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?} is not DIM=N (e.g. dp_shard=2,tp=2)"))?;
        let n: usize = v
            .trim()
            .parse()
            .map_err(|_| format!("{k}={v:?}: the size is not a whole number"))?;
        match k.trim() {
            "dp_replicate" => c.dp_replicate = n,
            "dp_shard" => c.dp_shard = n,
            "tp" => c.tp = n,
            "cp" => c.cp = n,
            other => {
                return Err(format!(
                    "unknown dimension {other:?}: use dp_replicate, dp_shard, tp or cp"
                ))
            }
        }
    }
    let total = c.total().max(1);
    let c = c.for_world(total).map_err(|e| e.message().to_string())?;
    Ok(Split {
        dp_replicate: c.dp_replicate,
        dp_shard: c.dp_shard,
        tp: c.tp,
    })
}

/// `doc` as indented JSON and a newline (`--json`).
fn pretty_json(doc: &impl serde::Serialize) -> String {
    format!("{}\n", serde_json::to_string_pretty(doc).expect("json"))
}

/// Run `accel estimate-memory`; returns what to print on stdout.
pub fn estimate_memory(args: &EstimateArgs) -> Result<String> {
    let (layout, _) = args.model.load_with_notes()?;
    let rows = estimate(&layout, &args.model.no_split, &args.dtypes)?;
    if let Some(split) = args.parallelism {
        let floats: Vec<String> = rows
            .iter()
            .filter(|r| r.adam_training.is_some())
            .map(|r| r.dtype.clone())
            .collect();
        let ranks = per_rank(&layout, &floats, split)?;
        if args.json {
            return Ok(pretty_json(
                &serde_json::json!({"model": rows, "per_rank": ranks}),
            ));
        }
        return Ok(per_rank_table(&ranks, split));
    }
    if args.json {
        return Ok(pretty_json(&rows));
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

/// The per-rank table of `accel estimate-memory --parallelism`.
fn per_rank_table(ranks: &[RankEstimate], split: Split) -> String {
    let mut s = String::new();
    let n = split.dp_replicate * split.dp_shard * split.tp;
    let _ = writeln!(
        s,
        "per rank at dp_replicate={} x dp_shard={} x tp={} ({n} ranks), Adam, no activations:",
        split.dp_replicate, split.dp_shard, split.tp
    );
    let _ = writeln!(
        s,
        "{:<6} {:>14} {:>14} {:>14} {:>14}",
        "dtype", "parameters", "gradients", "optimizer", "total"
    );
    for r in ranks {
        let _ = writeln!(
            s,
            "{:<6} {:>14} {:>14} {:>14} {:>14}",
            r.dtype,
            format_bytes(r.parameters),
            format_bytes(r.gradients),
            format_bytes(r.optimizer),
            format_bytes(r.total)
        );
    }
    if let Some(r) = ranks.first().filter(|r| !r.tp_indivisible.is_empty()) {
        let _ = writeln!(
            s,
            "kept whole on every tp rank (no dimension divisible by {}): {}",
            split.tp,
            r.tp_indivisible.join(", ")
        );
    }
    let _ = writeln!(
        s,
        "tp divides each matrix along a dimension it divides and replicates vectors; \
         dp_shard (ZeRO-3 / FSDP) divides everything a rank holds; dp_replicate divides nothing"
    );
    s
}

#[cfg(test)]
mod tests {
    use accel_api::ErrorKind;

    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    enum Cmd {
        Plan(PlanArgs),
        EstimateMemory(EstimateArgs),
    }

    #[test]
    fn plan_and_estimate_from_a_checkpoint() {
        let layout = accel_offload::synth::llama_layout(
            accel_offload::synth::LlamaShape::tiny(4, 0),
            DType::F32,
        );
        let d = tempfile::tempdir().unwrap();
        accel_offload::synth::write_checkpoint(&layout, d.path(), 8 << 10).unwrap();
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
        assert!(estimate_memory(&EstimateArgs {
            json: false,
            ..e.clone()
        })
        .unwrap()
        .contains("training using Adam"));

        // Per rank at dp_shard=2 x tp=2: a quarter of the matrices' share
        // (the llama's vectors are small), in the table and the JSON.
        let Cmd::EstimateMemory(p) = Cmd::parse_from([
            "x",
            "estimate-memory",
            "--checkpoint",
            dir,
            "--dtypes",
            "f32",
            "--parallelism",
            "dp_shard=2,tp=2",
            "--json",
        ]) else {
            panic!()
        };
        let doc: serde_json::Value = serde_json::from_str(&estimate_memory(&p).unwrap()).unwrap();
        let rank = &doc["per_rank"][0];
        let whole = doc["model"][0]["adam_training"].as_u64().unwrap();
        let total = rank["total"].as_u64().unwrap();
        assert!(
            total * 4 >= whole && total * 3 < whole,
            "{total} of {whole}"
        );
        assert_eq!(rank["split"]["tp"], 2);
        let table = estimate_memory(&EstimateArgs { json: false, ..p }).unwrap();
        assert!(table.contains("dp_shard=2 x tp=2 (4 ranks)"), "{table}");
    }

    #[test]
    fn impossible_parallelism_is_refused_by_the_mesh_rules() {
        assert_eq!(
            parse_parallelism("dp_shard=2,tp=2").unwrap(),
            Split {
                dp_replicate: 1,
                dp_shard: 2,
                tp: 2
            }
        );
        for (bad, says) in [
            ("tp=2,dp_replicate=2", "dp_shard"),
            ("cp=2", "cp"),
            ("pp=2", "unknown dimension"),
            ("tp", "DIM=N"),
            ("tp=two", "whole number"),
            ("tp=0", "0"),
        ] {
            let e = parse_parallelism(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
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
        let mut shape = accel_offload::synth::LlamaShape::tiny(3, 0);
        shape.tied = true;
        let layout = accel_offload::synth::llama_layout(shape, DType::F32);
        let d = tempfile::tempdir().unwrap();
        accel_offload::synth::write_checkpoint(&layout, d.path(), 1 << 20).unwrap();
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
}
