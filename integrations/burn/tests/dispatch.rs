//! Big-model dispatch for burn on a checkpoint written by burn's own
//! safetensors store (four `Linear` blocks and a head, record-path names):
//! fully resident, all on disk, split between the device and disk, and
//! split between the device, the host store and disk (the NdArray device
//! stands in for the plan's accelerator), each with and without the
//! prefetch thread; the outputs are bit-identical to each other and to the
//! plain module's forward. Offloaded parameters hold no element between
//! passes. A missing tensor or one of another shape is an error naming it.

use std::path::Path;

use accel_burn::dispatch::{load_checkpoint_and_dispatch, DispatchOptions, Dispatched};
use accel_offload::plan::MaxMemory;
use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_store::{ModuleSnapshot, SafetensorsStore};

const W: usize = 32;
const OUT: usize = 8;
const BLOCKS: [&str; 5] = ["layers.0", "layers.1", "layers.2", "layers.3", "head"];

#[derive(Module, Debug)]
struct Net {
    layers: Vec<Linear>,
    head: Linear,
}

impl Net {
    /// Block `i` of the forward pass.
    fn step(&self, i: usize, h: Tensor<2>) -> Tensor<2> {
        match self.layers.get(i) {
            Some(l) => l.forward(h).tanh(),
            None => self.head.forward(h),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        (0..BLOCKS.len()).fold(x, |h, i| self.step(i, h))
    }

    /// Elements the module's float parameters hold.
    fn held(&self) -> usize {
        self.layers
            .iter()
            .chain([&self.head])
            .map(|l| {
                l.weight.val().shape().num_elements()
                    + l.bias
                        .as_ref()
                        .map_or(0, |b| b.val().shape().num_elements())
            })
            .sum()
    }
}

fn device() -> Device {
    Device::default()
}

fn det(a: usize, b: usize) -> f32 {
    ((a * 31 + b * 17) % 23) as f32 / 23.0 - 0.5
}

/// A layer with deterministic values (`bias`: whether it has one).
fn linear(i: usize, out: usize, bias: bool) -> Linear {
    let d = device();
    let w: Vec<f32> = (0..W * out).map(|j| det(i + 1, j) * 0.4).collect();
    let b: Vec<f32> = (0..out).map(|j| det(i + 7, j) * 0.1).collect();
    Linear {
        weight: Param::from_data(TensorData::new(w, [W, out]), &d),
        bias: bias.then(|| Param::from_data(TensorData::new(b, [out]), &d)),
    }
}

/// The model with values, `head_bias` whether its head has a bias.
fn source(head_bias: bool) -> Net {
    Net {
        layers: (0..4).map(|i| linear(i, W, true)).collect(),
        head: linear(4, OUT, head_bias),
    }
}

/// The model as a big-model program builds it: burn's `init`, its
/// parameters lazy (nothing allocated until dispatch loads them).
fn lazy(out: usize) -> Net {
    let d = device();
    Net {
        layers: (0..4).map(|_| LinearConfig::new(W, W).init(&d)).collect(),
        head: LinearConfig::new(W, out).init(&d),
    }
}

fn save(net: &Net, path: &Path) {
    let mut store = SafetensorsStore::from_file(path);
    net.save_into(&mut store).unwrap();
}

fn input() -> Tensor<2> {
    let x: Vec<f32> = (0..3 * W).map(|j| det(99, j)).collect();
    Tensor::from_data(TensorData::new(x, [3, W]), &device())
}

fn values(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

/// One forward pass through `d`, block by block; checks that each
/// block's parameters are loaded while it runs and released after.
fn forward_dispatched(d: &Dispatched<Net>) -> Vec<f32> {
    let idle = d.module().unwrap().held();
    let mut h = Some(input());
    d.run(|i, block, net| {
        assert_eq!(block, BLOCKS[i]);
        let l = net.layers.get(i).unwrap_or(&net.head);
        let out = if i < 4 { W } else { OUT };
        assert_eq!(l.weight.val().dims(), [W, out], "{block} is loaded");
        if !d.blocks()[i].tensors.is_empty() {
            assert!(net.held() > idle, "{block}'s record is loaded");
        }
        h = Some(net.step(i, h.take().unwrap()));
        Ok(())
    })
    .unwrap();
    assert_eq!(d.module().unwrap().held(), idle, "a block stayed loaded");
    values(h.unwrap())
}

fn opts(budget: Option<&str>, lookahead: usize) -> DispatchOptions {
    DispatchOptions {
        max_memory: budget.map(|b| MaxMemory::parse(b).unwrap()),
        lookahead,
        ..DispatchOptions::default()
    }
}

#[test]
fn resident_and_offloaded_outputs_are_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let src = source(true);
    save(&src, &path);
    let want = values(src.forward(input()));

    let all = load_checkpoint_and_dispatch(lazy(OUT), &path, &BLOCKS, &opts(None, 1)).unwrap();
    let total = all.report().resident_bytes;
    assert_eq!(all.report().tensors, 10, "{:?}", all.report());
    assert_eq!(total, ((4 * (W * W + W) + W * OUT + OUT) * 4) as u64);
    assert!(all.report().unexpected.is_empty(), "{:?}", all.report());
    let resident = forward_dispatched(&all);
    assert_eq!(resident, want, "resident against the plain module");

    for budget in ["disk", "cpu=14KiB,disk", "cuda:0=9KiB,cpu=9KiB,disk"] {
        for lookahead in [0, 1] {
            let what = format!("{budget} lookahead {lookahead}");
            let d = load_checkpoint_and_dispatch(
                lazy(OUT),
                &path,
                &BLOCKS,
                &opts(Some(budget), lookahead),
            )
            .unwrap();
            let r = d.report().clone();
            println!("{what}: {r:?}\n{:?}", d.plan().map);
            assert_eq!(
                r.resident_bytes + r.host_bytes + r.disk_bytes,
                total,
                "{what}"
            );
            assert!(r.disk_bytes > 0, "{what}: {r:?}");
            // Disk tensors are the checkpoint's own bytes, served in place.
            assert_eq!(r.disk_bytes, r.disk_in_place_bytes, "{what}");
            match budget {
                "disk" => assert_eq!(r.resident_bytes, 0, "{what}"),
                "cpu=14KiB,disk" => {
                    assert!(r.resident_bytes > 0 && r.host_bytes == 0, "{what}: {r:?}")
                }
                _ => assert!(r.resident_bytes > 0 && r.host_bytes > 0, "{what}: {r:?}"),
            }
            // Between passes offloaded parameters hold no element.
            assert_eq!(
                d.module().unwrap().held() * 4,
                r.resident_bytes as usize,
                "{what}"
            );
            assert_eq!(forward_dispatched(&d), resident, "{what}");
            // A second pass reads the offloaded blocks again.
            assert_eq!(forward_dispatched(&d), resident, "{what}, again");
        }
    }
}

#[test]
fn errors_name_the_tensor_or_block() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    // A checkpoint without the head's bias.
    save(&source(false), &path);
    let e = load_checkpoint_and_dispatch(lazy(OUT), &path, &BLOCKS, &opts(None, 1)).unwrap_err();
    assert!(e.to_string().contains("head.bias"), "{e}");

    // A parameter of another shape.
    let path = dir.path().join("full.safetensors");
    save(&source(true), &path);
    let e = load_checkpoint_and_dispatch(lazy(4), &path, &BLOCKS, &opts(None, 1)).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("head.weight") && msg.contains("[32, 4]") && msg.contains("[32, 8]"),
        "{e}"
    );

    // A block that is no submodule.
    let e = load_checkpoint_and_dispatch(lazy(OUT), &path, &["nope"], &opts(None, 1)).unwrap_err();
    assert!(e.to_string().contains("`nope`"), "{e}");

    // Offloaded parameters that no block would load.
    let e = load_checkpoint_and_dispatch(lazy(OUT), &path, &BLOCKS[..2], &opts(Some("disk"), 1))
        .unwrap_err();
    assert!(e.to_string().contains("no block covers"), "{e}");

    // Two accelerators: one device only.
    let e = load_checkpoint_and_dispatch(
        lazy(OUT),
        &path,
        &BLOCKS,
        &opts(Some("cuda:0=5KiB,cuda:1=5KiB,cpu=20KiB"), 1),
    )
    .unwrap_err();
    assert!(e.to_string().contains("cuda:1"), "{e}");
}
