//! Dispatch of tch models (accel_tch::dispatch): a three-block model whose
//! module order is not alphabetical, with a tied head absent from the
//! checkpoint, loaded from single and sharded safetensors under budgets that
//! put blocks on cpu and disk; outputs compared with the model loaded
//! directly.

use std::path::Path;

use accel_api::{DType, ErrorKind, TensorMeta};
use accel_offload::plan::{MaxMemory, Target};
use accel_offload::safetensors::{write_file, write_sharded};
use accel_tch::dispatch::{layout_json, load_checkpoint_and_dispatch, DispatchOptions, ModelSpec};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

/// zeta (Linear 8->16), alpha and beta (Linear 16->16, relu), head (16->8
/// through zeta's weight, tied).
struct Net {
    zw: Tensor,
    zb: Tensor,
    aw: Tensor,
    ab: Tensor,
    bw: Tensor,
    bb: Tensor,
    hw: Tensor,
}

impl Net {
    fn new(vs: &VarStore) -> Net {
        let r = vs.root();
        let e = |p: &tch::nn::Path<'_>, n: &str, d: &[i64]| {
            p.add(n, Tensor::empty(d, (Kind::Float, Device::Cpu)), true)
        };
        Net {
            zw: e(&r.sub("zeta"), "weight", &[16, 8]),
            zb: e(&r.sub("zeta"), "bias", &[16]),
            aw: e(&r.sub("alpha"), "weight", &[16, 16]),
            ab: e(&r.sub("alpha"), "bias", &[16]),
            bw: e(&r.sub("beta"), "weight", &[16, 16]),
            bb: e(&r.sub("beta"), "bias", &[16]),
            hw: e(&r.sub("head"), "weight", &[16, 8]),
        }
    }

    fn spec() -> ModelSpec {
        ModelSpec::new()
            .block("zeta", Some("Linear"))
            .block("alpha", Some("Linear"))
            .block("beta", Some("Linear"))
            .block("head", Some("Head"))
            .tie(&["zeta.weight", "head.weight"])
    }

    fn step(&self, i: usize, x: Tensor) -> Tensor {
        match i {
            0 => x.linear(&self.zw, Some(&self.zb)),
            1 => x.linear(&self.aw, Some(&self.ab)).relu(),
            2 => x.linear(&self.bw, Some(&self.bb)).relu(),
            _ => x.matmul(&self.hw),
        }
    }

    fn forward(
        &self,
        d: &accel_tch::Dispatched,
        x: &Tensor,
    ) -> (Tensor, accel_offload::exec::ExecStats) {
        let mut h = Some(x.shallow_clone());
        let stats = d
            .run(|i, _| {
                h = Some(self.step(i, h.take().unwrap()));
                Ok(())
            })
            .unwrap();
        (h.unwrap(), stats)
    }
}

/// Weights (the checkpoint's tensors; head.weight is zeta.weight's tie and
/// not stored). Deterministic without libtorch's global generator, which
/// the tests running in parallel threads would share.
fn weights() -> Vec<(&'static str, Tensor)> {
    vec![
        ("zeta.weight", det(&[16, 8], 1.0)),
        ("zeta.bias", det(&[16], 2.0)),
        ("alpha.weight", det(&[16, 16], 3.0)),
        ("alpha.bias", det(&[16], 4.0)),
        ("beta.weight", det(&[16, 16], 5.0)),
        ("beta.bias", det(&[16], 6.0)),
    ]
}

/// `shape` filled with values in [-1, 1] that depend only on the index and
/// `salt`.
fn det(shape: &[i64], salt: f32) -> Tensor {
    let n: i64 = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i as f32 + 1.0) * 0.618 + salt * 1.7).sin())
        .collect();
    Tensor::from_slice(&v).view(shape)
}

fn bytes_of(t: &Tensor) -> Vec<u8> {
    accel_tch::ffi::host_view(t).unwrap().bytes().to_vec()
}

fn write_checkpoint(dir: &Path, sharded: bool, skip: Option<&str>) -> std::path::PathBuf {
    let w = weights();
    let data: Vec<(&str, TensorMeta, Vec<u8>)> = w
        .iter()
        .filter(|(n, _)| Some(*n) != skip)
        .map(|(n, t)| {
            let meta = TensorMeta {
                dtype: DType::F32,
                shape: t.size().iter().map(|&d| d as usize).collect(),
            };
            (*n, meta, bytes_of(t))
        })
        .collect();
    let refs: Vec<(&str, &TensorMeta, &[u8])> =
        data.iter().map(|(n, m, b)| (*n, m, b.as_slice())).collect();
    if sharded {
        let d = dir.join("sharded");
        write_sharded(&d, &refs, 600).unwrap();
        d
    } else {
        let p = dir.join("model.safetensors");
        write_file(&p, refs).unwrap();
        p
    }
}

/// The output with the weights copied in directly (no dispatch).
fn reference(x: &Tensor) -> Tensor {
    let w = weights();
    let g = |n: &str| w.iter().find(|(k, _)| *k == n).unwrap().1.shallow_clone();
    let h = x.linear(&g("zeta.weight"), Some(g("zeta.bias")));
    let h = h.linear(&g("alpha.weight"), Some(g("alpha.bias"))).relu();
    let h = h.linear(&g("beta.weight"), Some(g("beta.bias"))).relu();
    h.matmul(&g("zeta.weight"))
}

fn input() -> Tensor {
    Tensor::linspace(-1.0, 1.0, 24, (Kind::Float, Device::Cpu)).view([3, 8])
}

fn opts(max_memory: Option<&str>) -> DispatchOptions {
    DispatchOptions {
        max_memory: max_memory.map(|m| MaxMemory::parse(m).unwrap()),
        ..DispatchOptions::default()
    }
}

fn device_of(d: &accel_tch::Dispatched, entry: &str) -> Target {
    let (_, i) = d
        .plan()
        .map
        .iter()
        .find(|(n, _)| n == entry)
        .unwrap_or_else(|| panic!("no map entry {entry}: {:?}", d.plan().map));
    d.plan().devices[*i].device.clone()
}

#[test]
fn layout_follows_the_model_order_not_the_alphabet() {
    let vs = VarStore::new(Device::Cpu);
    let _net = Net::new(&vs);
    let l = layout_json(&vs, &Net::spec()).unwrap();
    let names: Vec<&str> = l.root.children.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["zeta", "alpha", "beta", "head"]);
    assert_eq!(l.root.children[1].class.as_deref(), Some("Linear"));
    assert_eq!(
        l.tied,
        vec![vec!["zeta.weight".to_string(), "head.weight".to_string()]]
    );
}

#[test]
fn resident_and_offloaded_runs_give_the_reference_output() {
    let tmp = tempfile::tempdir().unwrap();
    let x = input();
    let want = reference(&x);
    for sharded in [false, true] {
        let ck = write_checkpoint(tmp.path(), sharded, None);
        for budget in [None, Some("disk"), Some("cpu=1700,disk")] {
            for lookahead in [0, 1, 2] {
                let vs = VarStore::new(Device::Cpu);
                let net = Net::new(&vs);
                let o = DispatchOptions {
                    lookahead,
                    ..opts(budget)
                };
                let d = load_checkpoint_and_dispatch(&vs, &Net::spec(), &ck, &o).unwrap();
                let (got, stats) = net.forward(&d, &x);
                let what = format!("sharded={sharded} budget={budget:?} lookahead={lookahead}");
                assert_eq!(stats.layers, 4, "{what}");
                let diff = (&got - &want).abs().max().double_value(&[]);
                assert_eq!(diff, 0.0, "{what}: output differs by {diff}");
                // A second pass reads the offloaded blocks again.
                let (again, _) = net.forward(&d, &x);
                assert_eq!(
                    (&again - &want).abs().max().double_value(&[]),
                    0.0,
                    "{what}"
                );
                let r = d.report();
                assert_eq!(r.tensors, 6, "{what}");
                // Disk tensors are the checkpoint's own bytes, served in place.
                assert_eq!(r.disk_bytes, r.disk_in_place_bytes, "{what}");
                match budget {
                    None => {
                        assert_eq!(r.disk_bytes, 0, "{what}");
                        assert_eq!(stats.tied_uploads, 0, "{what}");
                    }
                    Some("disk") => {
                        assert_eq!(r.resident_bytes, 0, "{what}");
                        // The tie is materialised once per pass, for zeta and head.
                        assert_eq!(stats.tied_uploads, 1, "{what}");
                        // Between passes the offloaded variables hold nothing.
                        assert_eq!(net.aw.numel(), 0, "{what}");
                        assert_eq!(net.hw.numel(), 0, "{what}");
                        // A temporary offload folder lives as long as the model.
                        let dir = d.offload_dir().unwrap().to_path_buf();
                        assert!(dir.is_dir(), "{what}");
                        drop(d);
                        assert!(!dir.exists(), "{what}: {} left behind", dir.display());
                    }
                    Some(_) => {
                        // zeta (576 bytes) comes first in the model and fits
                        // next to the reservation for the largest layer (1088);
                        // alpha does not, and beta follows it. In alphabetical
                        // order alpha would be tried first and everything
                        // would land on disk.
                        assert_eq!(device_of(&d, "zeta"), Target::Cpu, "{what}");
                        assert_eq!(device_of(&d, "alpha"), Target::Disk, "{what}");
                        assert_eq!(device_of(&d, "beta"), Target::Disk, "{what}");
                        assert_eq!(net.zw.size(), [16, 8], "{what}");
                        assert_eq!(net.aw.numel(), 0, "{what}");
                    }
                }
            }
        }
    }
}

#[test]
fn converted_disk_tensors_go_to_the_offload_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = write_checkpoint(tmp.path(), false, None);
    let vs = VarStore::new(Device::Cpu);
    let net = Net::new(&vs);
    let off = tmp.path().join("offload");
    let o = DispatchOptions {
        dtype: Some(DType::F16),
        offload_dir: Some(off.clone()),
        ..opts(Some("disk"))
    };
    let d = load_checkpoint_and_dispatch(&vs, &Net::spec(), &ck, &o).unwrap();
    assert_eq!(d.report().disk_in_place_bytes, 0);
    assert_eq!(
        d.report().disk_bytes,
        (16 * 8 + 16 + 2 * (16 * 16 + 16)) * 2
    );
    assert!(off.join("alpha.weight.safetensors").exists());
    let x = input().to_kind(Kind::Half);
    let mut h = Some(x);
    d.run(|i, _| {
        // alpha's weight is materialised (as f16) only while its block runs.
        assert_eq!(net.aw.numel(), if i == 1 { 256 } else { 0 });
        assert_eq!(net.aw.kind(), Kind::Half);
        h = Some(net.step(i, h.take().unwrap()));
        Ok(())
    })
    .unwrap();
    let got = h.unwrap().to_kind(Kind::Float);
    let want = reference(&input());
    let rel = ((&got - &want).abs().max() / want.abs().max()).double_value(&[]);
    assert!(rel < 2e-2, "f16 output off by {rel} (relative)");
}

#[test]
fn errors_name_the_tensor_or_module() {
    let tmp = tempfile::tempdir().unwrap();
    // A variable missing from the checkpoint.
    let ck = write_checkpoint(tmp.path(), false, Some("alpha.bias"));
    let vs = VarStore::new(Device::Cpu);
    let _net = Net::new(&vs);
    let e = load_checkpoint_and_dispatch(&vs, &Net::spec(), &ck, &opts(None)).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("alpha.bias"), "{e}");

    // A shape that differs.
    let ok = tmp.path().join("ok");
    std::fs::create_dir_all(&ok).unwrap();
    let ck = write_checkpoint(&ok, false, None);
    let vs = VarStore::new(Device::Cpu);
    let r = vs.root();
    let _z = r.sub("zeta").add(
        "weight",
        Tensor::empty([16, 9], (Kind::Float, Device::Cpu)),
        true,
    );
    let _b = r.sub("zeta").add(
        "bias",
        Tensor::empty([16], (Kind::Float, Device::Cpu)),
        true,
    );
    let spec = ModelSpec::new().block("zeta", None);
    let e = load_checkpoint_and_dispatch(&vs, &spec, &ck, &opts(None)).unwrap_err();
    assert!(
        e.to_string().contains("zeta.weight") && e.to_string().contains("[16, 9]"),
        "{e}"
    );

    // A block or module that is no module of the model.
    let vs = VarStore::new(Device::Cpu);
    let _net = Net::new(&vs);
    let e = load_checkpoint_and_dispatch(&vs, &Net::spec().block("gamma", None), &ck, &opts(None))
        .unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("`gamma`"), "{e}");

    // A budget without room: the planner's error, before anything is read.
    let e =
        load_checkpoint_and_dispatch(&vs, &Net::spec(), &ck, &opts(Some("cpu=100"))).unwrap_err();
    assert!(!e.to_string().is_empty());
}

#[test]
fn models_built_from_tch_layers_dispatch_too() {
    // tch's own layers initialise their variables; dispatch replaces them.
    let tmp = tempfile::tempdir().unwrap();
    tch::manual_seed(3);
    let src = VarStore::new(Device::Cpu);
    let fc1 = tch::nn::linear(src.root() / "fc1", 8, 16, Default::default());
    let fc2 = tch::nn::linear(src.root() / "fc2", 16, 4, Default::default());
    let x = input();
    let want = {
        use tch::nn::Module;
        fc2.forward(&fc1.forward(&x).relu())
    };
    let ck = tmp.path().join("model.safetensors");
    let vars = src.variables();
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    let data: Vec<(String, TensorMeta, Vec<u8>)> = names
        .iter()
        .map(|n| {
            let t = &vars[*n];
            let meta = TensorMeta {
                dtype: DType::F32,
                shape: t.size().iter().map(|&d| d as usize).collect(),
            };
            (n.to_string(), meta, bytes_of(t))
        })
        .collect();
    write_file(
        &ck,
        data.iter().map(|(n, m, b)| (n.as_str(), m, b.as_slice())),
    )
    .unwrap();

    let vs = VarStore::new(Device::Cpu);
    let g1 = tch::nn::linear(vs.root() / "fc1", 8, 16, Default::default());
    let g2 = tch::nn::linear(vs.root() / "fc2", 16, 4, Default::default());
    let spec = ModelSpec::new()
        .block("fc1", Some("Linear"))
        .block("fc2", Some("Linear"));
    let d = load_checkpoint_and_dispatch(&vs, &spec, &ck, &opts(Some("disk"))).unwrap();
    assert_eq!(
        g1.ws.numel(),
        0,
        "an offloaded layer holds nothing between passes"
    );
    let mut h = Some(x.shallow_clone());
    d.run(|i, _| {
        use tch::nn::Module;
        let y = h.take().unwrap();
        h = Some(if i == 0 {
            g1.forward(&y).relu()
        } else {
            g2.forward(&y)
        });
        Ok(())
    })
    .unwrap();
    let diff = (h.unwrap() - want).abs().max().double_value(&[]);
    assert_eq!(diff, 0.0);
}

#[test]
fn a_tie_stored_under_its_later_name_is_read_as_the_owner() {
    // The checkpoint kept head.weight (the copy later in the model) and
    // dropped zeta.weight, the owner.
    let tmp = tempfile::tempdir().unwrap();
    let data: Vec<(String, TensorMeta, Vec<u8>)> = weights()
        .iter()
        .map(|(n, t)| {
            let name = if *n == "zeta.weight" {
                "head.weight"
            } else {
                n
            };
            let meta = TensorMeta {
                dtype: DType::F32,
                shape: t.size().iter().map(|&d| d as usize).collect(),
            };
            (name.to_string(), meta, bytes_of(t))
        })
        .collect();
    let ck = tmp.path().join("model.safetensors");
    write_file(
        &ck,
        data.iter().map(|(n, m, b)| (n.as_str(), m, b.as_slice())),
    )
    .unwrap();
    let x = input();
    let want = reference(&x);
    for budget in [None, Some("disk")] {
        let vs = VarStore::new(Device::Cpu);
        let net = Net::new(&vs);
        let d = load_checkpoint_and_dispatch(&vs, &Net::spec(), &ck, &opts(budget)).unwrap();
        assert_eq!(d.report().tensors, 6, "{budget:?}");
        assert!(d.report().unexpected.is_empty(), "{budget:?}");
        let (got, _) = net.forward(&d, &x);
        let diff = (&got - &want).abs().max().double_value(&[]);
        assert_eq!(diff, 0.0, "{budget:?}: output differs by {diff}");
    }
}
