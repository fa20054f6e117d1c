//! accel-offload benchmarks: planning time, load throughput vs raw reads,
//! layer loop with and without prefetch.
//!
//! `cargo bench -p accel-offload` (env: `ACCEL_BENCH_GIB`, checkpoint size
//! for the load benchmark, default 2; `ACCEL_BENCH_DIR`, where to write it,
//! default the system temp dir; `ACCEL_BENCH_ONLY=plan`, the planning
//! lines alone).

use std::collections::HashMap;
use std::io::Read;
use std::time::{Duration, Instant};

use accel_api::{DType, OffloadStore, TensorMeta};
use accel_offload::exec::{run_layers, LayerSpec, WeightSource};
use accel_offload::layout::Layout;
use accel_offload::load::load_checkpoint;
use accel_offload::plan::{plan, MaxMemory, PlanOptions, Target};
use accel_offload::safetensors::Checkpoint;
use accel_offload::source::load_layout;
use accel_offload::store::{DiskStore, HostStore};
use accel_offload::synth::{llama_layout, tensor_bytes, write_checkpoint, LlamaShape};
use accel_offload::util::format_bytes;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn bench_plan(label: &str, layout: &Layout, spec: &str, no_split: &[&str]) {
    let opts = PlanOptions {
        max_memory: Some(MaxMemory::parse(spec).unwrap()),
        no_split: no_split.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    let mut times = vec![];
    let mut p = None;
    for _ in 0..7 {
        let t = Instant::now();
        p = Some(plan(layout, &opts).unwrap());
        times.push(t.elapsed());
    }
    let p = p.unwrap();
    let per: Vec<String> = p
        .devices
        .iter()
        .map(|d| format!("{}={}", d.device, format_bytes(d.used)))
        .collect();
    println!(
        "plan {label}: {} tensors, median {:.2} ms (min {:.2} ms); no_split {:?}; {} map entries; {}",
        layout.tensor_count(),
        median(times.clone()).as_secs_f64() * 1e3,
        times.iter().min().unwrap().as_secs_f64() * 1e3,
        no_split,
        p.map.len(),
        per.join(" ")
    );
}

/// `accel plan --layout FILE` without the process start and the table:
/// read and parse the layout file, plan, format the device map as JSON,
/// on the 394k-tensor MoE layout (128 layers × 1024 experts × 3).
fn bench_plan_command(dir: &std::path::Path, spec: &str) {
    let shape = LlamaShape {
        layers: 128,
        experts: 1024,
        ..LlamaShape::MOE_173K
    };
    let file = dir.join("moe-394k.json");
    let l = llama_layout(shape, DType::BF16);
    std::fs::write(&file, serde_json::to_vec(&l.to_json()).unwrap()).unwrap();
    drop(l);
    for no_split in [Some("LlamaDecoderLayer"), None] {
        let mut times = vec![];
        let mut planning = Duration::ZERO;
        for _ in 0..5 {
            let t = Instant::now();
            let (layout, _notes) = load_layout(None, Some(&file), &[]).unwrap();
            let opts = PlanOptions {
                max_memory: Some(MaxMemory::parse(spec).unwrap()),
                no_split: no_split.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            };
            let tp = Instant::now();
            let p = plan(&layout, &opts).unwrap();
            planning = tp.elapsed();
            let out = serde_json::to_string_pretty(&p.device_map()).unwrap();
            assert!(!out.is_empty());
            times.push(t.elapsed());
        }
        println!(
            "plan command moe-394k, no_split {no_split:?}: median {:.0} ms (min {:.0} ms) end to end; last run planned in {:.2} ms",
            median(times.clone()).as_secs_f64() * 1e3,
            times.iter().min().unwrap().as_secs_f64() * 1e3,
            planning.as_secs_f64() * 1e3,
        );
    }
}

fn raw_read(ck: &Checkpoint) -> Duration {
    let t = Instant::now();
    let mut buf = vec![0u8; 16 << 20];
    for p in &ck.shards {
        let mut f = std::fs::File::open(p).unwrap();
        while f.read(&mut buf).unwrap() > 0 {}
    }
    t.elapsed()
}

fn raw_read_fresh(ck: &Checkpoint) -> Duration {
    let t = Instant::now();
    let mut total = 0usize;
    for p in &ck.shards {
        total += std::fs::read(p).unwrap().len();
    }
    assert!(total > 0);
    t.elapsed()
}

fn bench_load(dir: &std::path::Path, gib: f64) {
    // A dense model of about `gib` GiB in bf16: hidden 4096, layers as needed.
    let per_layer = (3 * 4096 * 11008 + 4 * 4096 * 4096) * 2;
    let layers = ((gib * (1u64 << 30) as f64) / per_layer as f64)
        .ceil()
        .max(1.0) as usize;
    let shape = LlamaShape {
        hidden: 4096,
        intermediate: 11008,
        layers,
        heads: 32,
        kv_heads: 32,
        vocab: 32000,
        experts: 0,
        tied: false,
    };
    let layout = llama_layout(shape, DType::BF16);
    let ck_dir = dir.join("ckpt");
    let t = Instant::now();
    write_checkpoint(&layout, &ck_dir, 2 << 30).unwrap();
    let ck = Checkpoint::open(&ck_dir).unwrap();
    let bytes = ck.total_bytes();
    println!(
        "load: generated {} in {} shards ({} tensors) in {:.1} s",
        format_bytes(bytes),
        ck.shards.len(),
        ck.len(),
        t.elapsed().as_secs_f64()
    );
    let p = plan(
        &layout,
        &PlanOptions {
            max_memory: Some(MaxMemory::parse("cpu=1TiB").unwrap()),
            ..Default::default()
        },
    )
    .unwrap();
    for round in 0..2 {
        let raw = raw_read(&ck);
        let fresh = raw_read_fresh(&ck);
        let cpu = HostStore::new();
        let stores: HashMap<Target, &dyn OffloadStore> = [(Target::Cpu, &cpu as &dyn OffloadStore)]
            .into_iter()
            .collect();
        let t = Instant::now();
        load_checkpoint(&ck, &layout, &p, &stores, &mut |_| {}).unwrap();
        let load = t.elapsed();
        let gbs = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
        println!(
            "load round {round} (page cache warm): raw read into one 16 MiB buffer {:.2} GB/s, std::fs::read of each shard into a fresh buffer {:.2} GB/s, load_checkpoint into host store {:.2} GB/s; load/fresh-read ratio {:.2}",
            gbs(raw),
            gbs(fresh),
            gbs(load),
            fresh.as_secs_f64() / load.as_secs_f64()
        );
        drop(cpu);
    }
    let _ = std::fs::remove_dir_all(&ck_dir);
}

fn bench_prefetch(dir: &std::path::Path) {
    let n_layers = 12;
    let layer_bytes = 128usize << 20;
    let store = DiskStore::open(&dir.join("disk")).unwrap();
    let mut names = vec![];
    for i in 0..n_layers {
        let name = format!("layers.{i}.w");
        let meta = TensorMeta {
            dtype: DType::U8,
            shape: vec![layer_bytes],
        };
        store
            .put(&name, meta, &tensor_bytes(&name, layer_bytes))
            .unwrap();
        names.push(name);
    }
    let layout = Layout::from_tensors(
        names.iter().map(|n| {
            (
                n.clone(),
                TensorMeta {
                    dtype: DType::U8,
                    shape: vec![layer_bytes],
                },
            )
        }),
        &[],
    )
    .unwrap();
    let p = plan(
        &layout,
        &PlanOptions {
            max_memory: Some(MaxMemory::parse("disk").unwrap()),
            ..Default::default()
        },
    )
    .unwrap();
    let stores: HashMap<Target, &dyn OffloadStore> = [(Target::Disk, &store as &dyn OffloadStore)]
        .into_iter()
        .collect();
    let src = WeightSource::new(&layout, &p, stores);
    let layers: Vec<LayerSpec> = (0..n_layers)
        .map(|i| LayerSpec::module(&layout, &format!("layers.{i}")).unwrap())
        .collect();
    // Two regimes: compute-bound (compute 60 ms, about one fetch) and
    // fetch-bound (compute 20 ms). The ideal wall time with prefetch is one
    // fetch plus, per layer, the longer of fetch and compute; the fetch
    // time per layer is taken from the run without prefetch.
    for compute_ms in [60u64, 20] {
        prefetch_regime(&src, &layers, n_layers, layer_bytes, compute_ms);
    }
}

fn prefetch_regime(
    src: &WeightSource<'_>,
    layers: &[LayerSpec],
    n_layers: usize,
    layer_bytes: usize,
    compute_ms: u64,
) {
    let compute = Duration::from_millis(compute_ms);
    let mut results = vec![];
    let mut fetch_per_layer = Duration::ZERO;
    for lookahead in [0usize, 1, 2] {
        // upload = copy out of the mapping + one checksum pass, standing in
        // for a host-to-device copy; compute = a sleep, standing in for an
        // accelerator kernel that leaves the host CPU free.
        let upload = |_: &str, _: &TensorMeta, b: &[u8]| {
            let v = b.to_vec();
            std::hint::black_box(accel_offload::util::checksum(&v));
            Ok(v)
        };
        let stats = run_layers(src, layers, lookahead, upload, |_| {
            std::thread::sleep(compute);
            Ok(())
        })
        .unwrap();
        if lookahead == 0 {
            fetch_per_layer = stats.fetch / n_layers as u32;
        }
        let ideal = fetch_per_layer + fetch_per_layer.max(compute) * n_layers as u32;
        println!(
            "prefetch lookahead {lookahead}: {} layers × {} from the disk store, {} ms compute each: wall {:.0} ms, fetch {:.0} ms, stalled {:.0} ms; ideal {:.0} ms, wall/ideal {:.2}",
            n_layers,
            format_bytes(layer_bytes as u64),
            compute.as_millis(),
            stats.wall.as_secs_f64() * 1e3,
            stats.fetch.as_secs_f64() * 1e3,
            stats.stall.as_secs_f64() * 1e3,
            ideal.as_secs_f64() * 1e3,
            stats.wall.as_secs_f64() / ideal.as_secs_f64()
        );
        results.push(stats.wall);
    }
    println!(
        "prefetch speed-up at {compute_ms} ms compute (lookahead 2 vs off): {:.2}x",
        results[0].as_secs_f64() / results[2].as_secs_f64()
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let gib: f64 = std::env::var("ACCEL_BENCH_GIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    let base = std::env::var("ACCEL_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir());
    let dir = tempfile::tempdir_in(base).unwrap();

    let t = Instant::now();
    let llama = llama_layout(LlamaShape::LLAMA_70B, DType::BF16);
    println!(
        "built Llama-70B layout in {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    bench_plan(
        "llama-70b",
        &llama,
        "cuda:0=40GiB,cuda:1=40GiB,cpu=200GiB,disk",
        &["LlamaDecoderLayer"],
    );
    bench_plan(
        "llama-70b (offload)",
        &llama,
        "cuda:0=24GiB,cpu=48GiB,disk",
        &["LlamaDecoderLayer"],
    );
    let t = Instant::now();
    let moe = llama_layout(LlamaShape::MOE_173K, DType::BF16);
    println!(
        "built MoE layout in {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let spec = "cuda:0=80GiB,cuda:1=80GiB,cuda:2=80GiB,cuda:3=80GiB,cpu=100GiB,disk";
    bench_plan("moe-173k", &moe, spec, &["LlamaDecoderLayer"]);
    bench_plan("moe-173k (split to experts)", &moe, spec, &[]);
    drop(moe);
    // The two layouts Accelerate was timed on (docs/benchmarks.md): 512
    // and 1024 experts in each of 128 layers.
    for (label, experts) in [("moe-197k", 512), ("moe-394k", 1024)] {
        let shape = LlamaShape {
            layers: 128,
            experts,
            ..LlamaShape::MOE_173K
        };
        let moe = llama_layout(shape, DType::BF16);
        bench_plan(label, &moe, spec, &["LlamaDecoderLayer"]);
        bench_plan(&format!("{label} (split to experts)"), &moe, spec, &[]);
    }
    bench_plan_command(dir.path(), spec);

    // `ACCEL_BENCH_ONLY=plan`: the planner lines alone (no 2 GiB checkpoint).
    if std::env::var("ACCEL_BENCH_ONLY").as_deref() == Ok("plan") {
        return;
    }
    bench_load(dir.path(), gib);
    bench_prefetch(dir.path());
}
