//! Big-model dispatch for candle on a checkpoint written by candle (four
//! `Linear` blocks and a head): without a budget everything is resident;
//! with `--max-memory cpu=14KiB,disk` about half of the weights stay in
//! the checkpoint's shard on disk, each block's storage is filled just before it runs
//! (with and without the prefetch thread) and emptied after; the outputs
//! equal the model loaded whole, bit for bit. A disk tensor that no block
//! covers is refused.

use std::collections::HashMap;
use std::path::Path;

use accel_candle::{load_checkpoint_and_dispatch, DispatchOptions, Dispatched};
use accel_offload::plan::MaxMemory;
use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, Module, VarBuilder};

const W: usize = 32;
const BLOCKS: [&str; 5] = ["layers.0", "layers.1", "layers.2", "layers.3", "head"];

fn det(a: usize, b: usize) -> f32 {
    ((a * 31 + b * 17) % 23) as f32 / 23.0 - 0.5
}

fn write_checkpoint(path: &Path) {
    let mut m = HashMap::new();
    for (i, b) in BLOCKS.iter().enumerate() {
        let out = if *b == "head" { 8 } else { W };
        let w: Vec<f32> = (0..out * W).map(|j| det(i + 1, j) * 0.4).collect();
        let bias: Vec<f32> = (0..out).map(|j| det(i + 7, j) * 0.1).collect();
        m.insert(
            format!("{b}.weight"),
            Tensor::from_vec(w, (out, W), &Device::Cpu).unwrap(),
        );
        m.insert(
            format!("{b}.bias"),
            Tensor::from_vec(bias, out, &Device::Cpu).unwrap(),
        );
    }
    candle_core::safetensors::save(&m, path).unwrap();
}

fn layers(vb: &VarBuilder<'_>) -> Vec<Linear> {
    BLOCKS
        .iter()
        .map(|b| {
            let out = if *b == "head" { 8 } else { W };
            candle_nn::linear(W, out, vb.pp(b)).unwrap()
        })
        .collect()
}

fn input() -> Tensor {
    let x: Vec<f32> = (0..3 * W).map(|j| det(99, j)).collect();
    Tensor::from_vec(x, (3, W), &Device::Cpu).unwrap()
}

fn forward_whole(path: &Path) -> Vec<f32> {
    let tensors = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let mut h = input();
    for (i, l) in layers(&vb).iter().enumerate() {
        h = l.forward(&h).unwrap();
        if i + 1 < BLOCKS.len() {
            h = h.tanh().unwrap();
        }
    }
    h.flatten_all().unwrap().to_vec1().unwrap()
}

/// One forward pass through `d`, block by block; checks that each block's
/// tensors are filled while it runs.
fn forward_dispatched(d: &Dispatched) -> Vec<f32> {
    let model = layers(&d.var_builder(DType::F32));
    let idle = d.resident_numel();
    let mut h = Some(input());
    d.run(|i, name| {
        let offloaded: usize = d.blocks()[i].tensors.len();
        if offloaded > 0 {
            assert!(
                d.resident_numel() > idle,
                "block {name}'s offloaded tensors are not filled while it runs"
            );
        }
        let mut x = model[i].forward(&h.take().unwrap()).unwrap();
        if i + 1 < BLOCKS.len() {
            x = x.tanh().unwrap();
        }
        h = Some(x);
        Ok(())
    })
    .unwrap();
    assert_eq!(d.resident_numel(), idle, "a block's tensors stayed filled");
    h.unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn dispatched_blocks_from_disk_equal_the_whole_model() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_checkpoint(&path);
    let want = forward_whole(&path);

    let all = load_checkpoint_and_dispatch(&path, &BLOCKS, &DispatchOptions::default()).unwrap();
    assert_eq!(all.report().disk_bytes, 0, "{:?}", all.report());
    assert_eq!(forward_dispatched(&all), want, "no offload");

    let total = all.report().resident_bytes;
    for lookahead in [0, 1] {
        let opts = DispatchOptions {
            max_memory: Some(MaxMemory::parse("cpu=14KiB,disk").unwrap()),
            lookahead,
            ..DispatchOptions::default()
        };
        let d = load_checkpoint_and_dispatch(&path, &BLOCKS, &opts).unwrap();
        let r = d.report().clone();
        println!("lookahead {lookahead}: {r:?}");
        assert!(
            r.disk_bytes > 0 && r.resident_bytes > 0,
            "the budget should split the model between the CPU and disk: {r:?}"
        );
        assert_eq!(r.disk_bytes + r.resident_bytes, total);
        assert_eq!(
            d.resident_numel() * 4,
            r.resident_bytes as usize,
            "offloaded tensors hold storage between passes"
        );
        assert_eq!(forward_dispatched(&d), want, "lookahead {lookahead}");
        // A second pass reads the blocks again.
        assert_eq!(forward_dispatched(&d), want, "lookahead {lookahead}, again");
    }

    let opts = DispatchOptions {
        max_memory: Some(MaxMemory::parse("cpu=6KiB,disk").unwrap()),
        ..DispatchOptions::default()
    };
    let e = load_checkpoint_and_dispatch(&path, &BLOCKS[..2], &opts).unwrap_err();
    assert!(e.to_string().contains("no block covers"), "{e}");
    let e = load_checkpoint_and_dispatch(&path, &["nope"], &opts).unwrap_err();
    assert!(e.to_string().contains("`nope`"), "{e}");
}
