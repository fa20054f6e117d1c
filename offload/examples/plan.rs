//! A generator for large synthetic layouts, to time `accel plan` on them:
//!
//! ```sh
//! cargo build --release -p accel-offload --example plan -p accel-launcher
//! target/release/examples/plan write-moe --layers 128 --experts 1024 -o /tmp/moe.json
//! time target/release/accel plan --layout /tmp/moe.json \
//!     --max-memory cuda:0=80GiB,cuda:1=80GiB,cuda:2=80GiB,cuda:3=80GiB,cpu=100GiB,disk
//! ```
//!
//! `write-moe [--layers N (128)] [--experts N (1024)] -o FILE`: a
//! mixture-of-experts layout (Llama names, bf16).

use std::path::PathBuf;
use std::process::ExitCode;

use accel_api::DType;
use accel_offload::synth::{llama_layout, LlamaShape};

fn usage(msg: &str) -> ExitCode {
    eprintln!("plan: {msg}\nusage: plan write-moe [--layers N] [--experts N] -o FILE");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() != Some("write-moe") {
        return usage("the one command is write-moe");
    }
    let (mut layers, mut experts, mut output) = (128usize, 1024usize, None::<PathBuf>);
    while let Some(flag) = args.next() {
        let Some(value) = args.next() else {
            return usage(&format!("{flag} needs a value"));
        };
        match flag.as_str() {
            "--layers" | "--experts" => {
                let Ok(n) = value.parse() else {
                    return usage(&format!("{flag} {value:?} is not a number"));
                };
                if flag == "--layers" {
                    layers = n;
                } else {
                    experts = n;
                }
            }
            "-o" | "--output" => output = Some(value.into()),
            other => return usage(&format!("unknown flag {other}")),
        }
    }
    let Some(output) = output else {
        return usage("-o FILE is required");
    };
    let shape = LlamaShape {
        layers,
        experts,
        ..LlamaShape::MOE_173K
    };
    let layout = llama_layout(shape, DType::BF16);
    let json = serde_json::to_vec(&layout.to_json()).expect("a layout serialises");
    if let Err(e) = std::fs::write(&output, json) {
        eprintln!("plan: cannot write {}: {e}", output.display());
        return ExitCode::FAILURE;
    }
    println!("{}: {} tensors", output.display(), layout.tensor_count());
    ExitCode::SUCCESS
}
