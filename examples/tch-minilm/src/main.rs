//! `minilm-embed`: embed sentences with all-MiniLM-L6-v2 through accel-tch's
//! dispatch and print their cosine similarities and the process's peak
//! resident memory.
//!
//! ```text
//! minilm-embed                                   # everything resident
//! minilm-embed --max-memory cpu=20MiB,disk       # most layers on disk
//! minilm-embed --max-memory cpu=20MiB,disk --check-rss
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use accel_example_tch_minilm::{
    default_model_dir, embed_with_stats, similarities, Bert, Config, Tokenizer, SENTENCES,
};
use accel_offload::plan::{MaxMemory, Target};
use accel_offload::util::format_bytes;
use clap::Parser;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

/// libtorch's scratch buffers and allocator slack of one forward pass,
/// allowed on top of the budget, the blocks in flight and the batch's
/// activations by `--check-rss`.
const BASE_SLACK: u64 = 16 << 20;

/// What one forward pass over a padded `[n, t]` batch may hold at once,
/// generously: per token, a dozen hidden-size rows and three feed-forward
/// rows (the block's input, its attention's q, k, v, context and output,
/// residuals and norms; the feed-forward's up projection and GELU); per
/// head, three `t x t` score matrices (scores, softmax, dropout-free
/// copy); f32 throughout; twice that, for the freed activations of the
/// blocks before that the allocator keeps for reuse (glibc's dynamic mmap
/// threshold keeps them on the heap). 19 sentences of ~20 tokens: ~28 MiB.
fn activation_bytes(cfg: &Config, n: u64, t: u64) -> u64 {
    let per_token = (12 * cfg.hidden_size as u64 + 3 * cfg.intermediate_size as u64) * 4;
    let scores = 3 * cfg.num_attention_heads as u64 * t * t * 4;
    2 * n * (t * per_token + scores)
}

#[derive(Parser, Debug)]
#[command(about = "Sentence embeddings with all-MiniLM-L6-v2, dispatched with accel-tch")]
struct Args {
    /// The unpacked model (scripts/fetch_minilm.sh); default
    /// $ACCEL_MINILM_DIR or .accel-cache/minilm/model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Budgets, as `accel plan` takes them (cpu=20MiB,disk); none: no offload.
    #[arg(long)]
    max_memory: Option<String>,
    /// Blocks read ahead on the prefetch thread.
    #[arg(long, default_value_t = 1)]
    lookahead: usize,
    /// Fail when the peak resident memory of the run exceeds the baseline
    /// plus the cpu budget, the blocks in flight (the largest `lookahead + 1`
    /// consecutive ones), the batch's activations (from the number of
    /// sentences and their padded length) and a 16 MiB slack.
    #[arg(long)]
    check_rss: bool,
    /// Forward passes to run (timings of each are printed; the embeddings
    /// of the last one are shown).
    #[arg(long, default_value_t = 1)]
    passes: usize,
    /// Also write the model's layout (accel-layout/1 JSON, the model's module
    /// order) to this file, for `accel plan --layout`.
    #[arg(long)]
    write_layout: Option<PathBuf>,
    /// One JSON object on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// Sentences (default: the demo's six).
    sentences: Vec<String>,
}

/// (VmRSS, VmHWM) of this process in bytes.
fn rss() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |k: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("minilm-embed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> accel_api::Result<ExitCode> {
    let args = Args::parse();
    let dir = args.model.clone().unwrap_or_else(default_model_dir);
    let sentences: Vec<&str> = if args.sentences.is_empty() {
        SENTENCES.to_vec()
    } else {
        args.sentences.iter().map(String::as_str).collect()
    };
    let max_memory = args
        .max_memory
        .as_deref()
        .map(MaxMemory::parse)
        .transpose()?;
    let cfg = Config::load(&dir)?;
    let tok = Tokenizer::load(&dir)?;
    // Warm libtorch up (thread pool, kernels) so that the baseline holds the
    // runtime and the measured peak holds the model.
    {
        let _g = tch::no_grad_guard();
        let x = Tensor::ones([4, 8, 32], (Kind::Float, Device::Cpu));
        let _ = x
            .matmul(&x.transpose(-1, -2))
            .softmax(-1, Kind::Float)
            .gelu("none")
            .layer_norm(
                [8i64].as_slice(),
                None::<Tensor>,
                None::<Tensor>,
                1e-12,
                false,
            )
            .sum(Kind::Float);
    }
    let (baseline, _) = rss();
    // Start the peak from here (Linux: writing 5 to clear_refs resets VmHWM).
    let _ = std::fs::write("/proc/self/clear_refs", "5");

    let vs = VarStore::new(Device::Cpu);
    let model = Bert::new(&vs, &cfg);
    if let Some(p) = &args.write_layout {
        let l = accel_tch::dispatch::layout_json(&vs, &model.spec())?;
        let text = serde_json::to_string_pretty(&l).expect("a layout serialises");
        std::fs::write(p, text)
            .map_err(|e| accel_api::Error::io(format!("write {}", p.display()), e))?;
    }
    let d = model.dispatch(&vs, &dir, max_memory.clone(), args.lookahead)?;
    let mut runs = vec![];
    for _ in 0..args.passes.max(1) {
        runs.push(embed_with_stats(&tok, &model, &d, &sentences)?);
    }
    let all_stats: Vec<_> = runs.iter().map(|(_, s)| s.clone()).collect();
    let (emb, _) = runs.pop().expect("one pass at least");
    let sims = similarities(&emb);
    let (_, peak) = rss();
    let over = peak.saturating_sub(baseline);

    let cpu_budget = max_memory
        .as_ref()
        .and_then(|m| m.devices.iter().find(|(t, _)| *t == Target::Cpu))
        .and_then(|(_, b)| *b);
    // Bytes each block materialises; at most `lookahead + 1` consecutive
    // blocks are in memory at once (the one running and those read ahead).
    let block_bytes: Vec<u64> = d
        .blocks()
        .iter()
        .map(|b| {
            b.tensors
                .iter()
                .filter_map(|t| d.layout().id(t))
                .filter_map(|id| d.layout().node(id).bytes())
                .sum::<u64>()
        })
        .collect();
    let in_flight = (0..block_bytes.len())
        .map(|i| {
            block_bytes[i..block_bytes.len().min(i + args.lookahead + 1)]
                .iter()
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    let shape = tok.batch(&sentences)?.ids.size();
    let activations = activation_bytes(&cfg, shape[0] as u64, shape[1] as u64);
    let slack = BASE_SLACK + activations;
    let bound = cpu_budget.map(|b| b + in_flight + slack);
    let r = d.report();
    let devices: Vec<serde_json::Value> = d
        .plan()
        .devices
        .iter()
        .map(|p| serde_json::json!({"device": p.device, "bytes": p.used, "entries": p.entries}))
        .collect();

    if args.json {
        let v = serde_json::json!({
            "max_memory": args.max_memory,
            "sentences": sentences,
            "similarities": sims,
            "devices": devices,
            "resident_bytes": r.resident_bytes,
            "disk_bytes": r.disk_bytes,
            "baseline_rss": baseline,
            "peak_rss": peak,
            "peak_over_baseline": over,
            "bound_over_baseline": bound,
            "passes": all_stats.iter().map(|s| serde_json::json!({
                "wall_s": s.wall.as_secs_f64(),
                "compute_s": s.compute.as_secs_f64(),
                "fetch_s": s.fetch.as_secs_f64(),
                "stall_s": s.stall.as_secs_f64(),
                "ideal_s": s.ideal().as_secs_f64(),
            })).collect::<Vec<_>>(),
        });
        println!("{v}");
    } else {
        let label = args
            .max_memory
            .as_deref()
            .unwrap_or("none (everything resident)");
        println!("max memory: {label}");
        for p in &d.plan().devices {
            println!(
                "  {:>5}: {:>10} in {} map entries{}",
                p.device.to_string(),
                format_bytes(p.used),
                p.entries,
                p.empty_reason
                    .as_ref()
                    .map_or(String::new(), |r| format!(" ({r})"))
            );
        }
        println!(
            "  loaded: {} resident, {} on disk ({} served from the checkpoint in place), unused by the encoder: {:?}",
            format_bytes(r.resident_bytes),
            format_bytes(r.disk_bytes),
            format_bytes(r.disk_in_place_bytes),
            r.unexpected
        );
        for (k, stats) in all_stats.iter().enumerate() {
            println!(
                "forward {}: {} blocks in {:.1} ms: compute {:.1} ms, reading offloaded blocks {:.1} ms, waited for weights {:.1} ms; ideal pipeline {:.1} ms (wall / ideal {:.2})",
                k + 1,
                stats.layers,
                stats.wall.as_secs_f64() * 1e3,
                stats.compute.as_secs_f64() * 1e3,
                stats.fetch.as_secs_f64() * 1e3,
                stats.stall.as_secs_f64() * 1e3,
                stats.ideal().as_secs_f64() * 1e3,
                stats.wall.as_secs_f64() / stats.ideal().as_secs_f64().max(1e-9)
            );
        }
        println!("cosine similarities:");
        for (i, row) in sims.iter().enumerate() {
            let cells: Vec<String> = row.iter().map(|c| format!("{c:7.4}")).collect();
            println!("  [{i}] {} {:?}", cells.join(" "), sentences[i]);
        }
        println!(
            "resident memory: baseline {} (libtorch, tokenizer), peak {}, peak over baseline {}{}",
            format_bytes(baseline),
            format_bytes(peak),
            format_bytes(over),
            bound.map_or(String::new(), |b| format!(
                "; bound {} = cpu budget + {} in flight (the largest {} consecutive blocks) + {} activations ({} x {} tokens) + {} slack",
                format_bytes(b),
                format_bytes(in_flight),
                args.lookahead + 1,
                format_bytes(activations),
                shape[0],
                shape[1],
                format_bytes(BASE_SLACK)
            ))
        );
    }
    if args.check_rss {
        if let Some(b) = bound {
            if over > b {
                eprintln!(
                    "minilm-embed: peak resident memory {} over the baseline exceeds the bound {}",
                    format_bytes(over),
                    format_bytes(b)
                );
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
