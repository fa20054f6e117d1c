//! `candle-minilm`: sentence embeddings with all-MiniLM-L6-v2 on
//! candle-transformers' BERT, dispatched by accel-candle. Prints the
//! dispatch report and the cosine similarities of the example sentences
//! (or of the sentences given) as JSON.

use std::path::PathBuf;
use std::process::ExitCode;

use accel_example_candle_minilm::{default_model_dir, similarities, Minilm, SENTENCES};
use accel_offload::plan::MaxMemory;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    about = "all-MiniLM-L6-v2 sentence embeddings on candle, with accel's big-model dispatch"
)]
struct Args {
    /// Budgets, e.g. `cpu=20MiB,disk` (weights beyond the CPU budget stay
    /// on disk and are read a layer at a time); none: everything resident.
    #[arg(long)]
    max_memory: Option<String>,
    /// The model folder (`make minilm-setup`).
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// Blocks read ahead while one runs.
    #[arg(long, default_value_t = 1)]
    lookahead: usize,
    /// Sentences (default: six examples).
    sentences: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("candle-minilm: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> accel_api::Result<()> {
    let dir = args.model_dir.clone().unwrap_or_else(default_model_dir);
    let budget = args
        .max_memory
        .as_deref()
        .map(MaxMemory::parse)
        .transpose()?;
    let model = Minilm::load(&dir, budget, args.lookahead)?;
    let sentences: Vec<&str> = if args.sentences.is_empty() {
        SENTENCES.to_vec()
    } else {
        args.sentences.iter().map(String::as_str).collect()
    };
    let emb = model.embed(&sentences)?;
    let r = model.dispatched().report();
    let out = serde_json::json!({
        "resident_bytes": r.resident_bytes,
        "disk_bytes": r.disk_bytes,
        "peak_rss_kib": peak_rss_kib(),
        "sentences": sentences,
        "similarities": similarities(&emb),
    });
    println!("{out}");
    Ok(())
}

/// This process's peak resident set size (`VmHWM` in `/proc/self/status`),
/// in KiB; `None` where there is no such file.
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
