//! `accel plan` / `accel estimate-memory` as a stand-alone binary, plus a
//! generator for large synthetic layouts, so the whole command can be timed
//! without building the launcher:
//!
//! ```sh
//! cargo build --release -p accel-offload --example plan
//! target/release/examples/plan write-moe --layers 128 --experts 1024 -o /tmp/moe.json
//! time target/release/examples/plan plan --layout /tmp/moe.json \
//!     --max-memory cuda:0=80GiB,cuda:1=80GiB,cuda:2=80GiB,cuda:3=80GiB,cpu=100GiB,disk
//! ```

use std::path::PathBuf;

use accel_api::DType;
use accel_offload::synth::{llama_layout, LlamaShape};
use clap::Parser;

#[derive(Parser)]
enum Cmd {
    /// Same as `accel plan`.
    Plan(accel_offload::cli::PlanArgs),
    /// Same as `accel estimate-memory`.
    EstimateMemory(accel_offload::cli::EstimateArgs),
    /// Write a synthetic mixture-of-experts layout (Llama names, bf16).
    WriteMoe {
        /// Decoder layers.
        #[arg(long, default_value_t = 128)]
        layers: usize,
        /// Experts per layer (3 matrices each).
        #[arg(long, default_value_t = 1024)]
        experts: usize,
        /// Output file.
        #[arg(short, long)]
        output: PathBuf,
    },
}

fn main() {
    let res = match Cmd::parse() {
        Cmd::Plan(a) => accel_offload::cli::plan(&a),
        Cmd::EstimateMemory(a) => accel_offload::cli::estimate_memory(&a),
        Cmd::WriteMoe {
            layers,
            experts,
            output,
        } => {
            let shape = LlamaShape {
                layers,
                experts,
                ..LlamaShape::MOE_173K
            };
            let l = llama_layout(shape, DType::BF16);
            let text = serde_json::to_vec(&l.to_json()).expect("json");
            std::fs::write(&output, text)
                .map(|()| format!("{}: {} tensors\n", output.display(), l.tensor_count()))
                .map_err(|e| accel_api::Error::io(format!("write {}", output.display()), e))
        }
    };
    match res {
        Ok(s) => print!("{s}"),
        Err(e) => {
            eprintln!("plan: error: {e}");
            std::process::exit(1);
        }
    }
}
