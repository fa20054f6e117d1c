//! The dispatch pipeline with a framework of plain bytes (no tch, no
//! candle): a tie whose checkpoint kept the later copy, a tensor the model
//! lacks, budgets over a fake accelerator, cpu and disk, a dtype override;
//! every block sees the checkpoint's values on the execution device, and
//! the errors name what is wrong.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use accel_api::{DType, Error, ErrorKind, Result, TensorMeta};
use accel_offload::dispatch::{load_and_dispatch, DispatchOptions, Dispatched, Framework};
use accel_offload::layout::{Layout, LayoutJson, ModuleJson, TensorJson, LAYOUT_FORMAT};
use accel_offload::plan::{MaxMemory, Target};
use accel_offload::safetensors::write_file;

/// A tensor: where it lives, its meta and bytes (empty while offloaded).
#[derive(Debug, Clone, PartialEq)]
struct T {
    device: String,
    meta: TensorMeta,
    bytes: Vec<u8>,
}

/// Accelerators named `fake:N` exist; others do not.
#[derive(Debug, Default)]
struct Toy(Mutex<HashMap<String, T>>);

impl Toy {
    fn get(&self, name: &str) -> T {
        self.0.lock().unwrap()[name].clone()
    }
    fn set(&self, name: &str, t: T) {
        self.0.lock().unwrap().insert(name.to_string(), t);
    }
}

impl Framework for Toy {
    type Device = String;
    type Tensor = T;
    fn device(&self, target: &Target) -> Result<String> {
        match target {
            Target::Accelerator(a) if !a.starts_with("fake:") => Err(Error::new(
                ErrorKind::Unsupported,
                format!("no device {a} here"),
            )),
            t => Ok(t.to_string()),
        }
    }
    fn materialise(
        _: &str,
        meta: &TensorMeta,
        device: &String,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<T> {
        let mut bytes = vec![0; meta.byte_len()];
        fill(&mut bytes)?;
        let (device, meta) = (device.clone(), meta.clone());
        Ok(T {
            device,
            meta,
            bytes,
        })
    }
    fn keep(&mut self, name: &str, t: T) -> Result<()> {
        self.set(name, t);
        Ok(())
    }
    fn tie(&mut self, alias: &str, owner: &str) -> Result<()> {
        let t = self.get(owner);
        self.set(alias, t);
        Ok(())
    }
    fn offload(&mut self, name: &str, meta: &TensorMeta, device: &String) -> Result<()> {
        self.release(name, meta, device)
    }
    fn install(&self, name: &str, t: &T) -> Result<()> {
        assert!(self.get(name).bytes.is_empty(), "{name} installed twice");
        self.set(name, t.clone());
        Ok(())
    }
    fn release(&self, name: &str, meta: &TensorMeta, device: &String) -> Result<()> {
        let (device, meta) = (device.clone(), meta.clone());
        self.set(
            name,
            T {
                device,
                meta,
                bytes: vec![],
            },
        );
        Ok(())
    }
}

const BLOCKS: [&str; 4] = ["l0", "l1", "l2", "head"];

fn tensor(name: &str, shape: &[usize]) -> TensorJson {
    TensorJson {
        name: name.to_string(),
        dtype: DType::F32,
        shape: shape.to_vec(),
        persistent: true,
    }
}

/// l0 (w 4x4), l1 and l2 (w 4x4, b 4), head (w 4x4, tied to l0.w), in
/// that order.
fn layout() -> Result<Layout> {
    let module = |name: &str, params: Vec<TensorJson>| ModuleJson {
        name: name.to_string(),
        params,
        ..ModuleJson::default()
    };
    let w = || tensor("w", &[4, 4]);
    Layout::from_json(&LayoutJson {
        format: LAYOUT_FORMAT.to_string(),
        root: ModuleJson {
            children: vec![
                module("l0", vec![w()]),
                module("l1", vec![w(), tensor("b", &[4])]),
                module("l2", vec![w(), tensor("b", &[4])]),
                module("head", vec![w()]),
            ],
            ..ModuleJson::default()
        },
        tied: vec![vec!["l0.w".into(), "head.w".into()]],
    })
}

fn values(salt: f32, n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| (salt + i as f32 * 0.25).to_le_bytes())
        .collect()
}

/// The checkpoint keeps the tie as `head.w` (not its owner `l0.w`), and a
/// tensor the model lacks; `skip` leaves one out.
fn checkpoint(dir: &Path, skip: Option<&str>, l1w: &[usize]) -> PathBuf {
    let m = |shape: &[usize]| TensorMeta {
        dtype: DType::F32,
        shape: shape.to_vec(),
    };
    let t = [
        ("head.w", m(&[4, 4]), values(1.0, 16)),
        ("l1.w", m(l1w), values(2.0, l1w.iter().product())),
        ("l1.b", m(&[4]), values(3.0, 4)),
        ("l2.w", m(&[4, 4]), values(5.0, 16)),
        ("l2.b", m(&[4]), values(6.0, 4)),
        ("extra", m(&[2]), values(4.0, 2)),
    ];
    let path = dir.join("model.safetensors");
    let kept = t.iter().filter(|(n, _, _)| Some(*n) != skip);
    write_file(&path, kept.map(|(n, m, b)| (*n, m, b.as_slice()))).unwrap();
    path
}

/// What `name` holds in the checkpoint, as `dtype`.
fn want(name: &str, dtype: DType) -> Vec<u8> {
    let v = match name {
        "l0.w" | "head.w" => values(1.0, 16),
        "l1.w" => values(2.0, 16),
        "l1.b" => values(3.0, 4),
        "l2.w" => values(5.0, 16),
        _ => values(6.0, 4),
    };
    if dtype == DType::F32 {
        return v;
    }
    let f = v
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()));
    f.flat_map(|x| half::f16::from_f32(x).to_le_bytes())
        .collect()
}

fn dispatch(ck: &Path, opts: &DispatchOptions) -> Result<Dispatched<Toy>> {
    load_and_dispatch(Toy::default(), |_: &_| layout(), ck, &BLOCKS, opts)
}

fn opts(budget: &str) -> DispatchOptions {
    DispatchOptions {
        max_memory: Some(MaxMemory::parse(budget).unwrap()),
        lookahead: 1,
        ..DispatchOptions::default()
    }
}

/// One pass: every tensor of each block holds the checkpoint's values on
/// the execution device (or its resident device) while the block runs,
/// and offloaded ones are empty again after it.
fn check_pass(d: &Dispatched<Toy>, dtype: DType) {
    let fw = d.framework();
    let stats = d
        .run(|i, block| {
            for name in d.layout().tensors_under(block).unwrap() {
                let t = fw.get(&name);
                assert_eq!(t.bytes, want(&name, dtype), "{name} in block {i}");
                let offloaded = d.blocks()[i].tensors.contains(&name);
                if offloaded {
                    assert_eq!(&t.device, d.device(), "{name}");
                }
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(stats.layers, 4);
    for b in d.blocks() {
        for name in &b.tensors {
            assert!(fw.get(name).bytes.is_empty(), "{name} stayed filled");
        }
    }
}

#[test]
fn every_block_sees_the_checkpoint_wherever_it_was_planned() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = checkpoint(tmp.path(), None, &[4, 4]);
    for budget in [
        "cpu=100000",
        "disk",
        "cpu=150,disk",
        "fake:0=150,cpu=170,disk",
        "fake:0=150,cpu=100000",
        "fake:0=100000",
    ] {
        let d = dispatch(&ck, &opts(budget)).unwrap();
        let r = d.report();
        assert_eq!(r.tensors, 5, "{budget}");
        assert_eq!(r.unexpected, ["extra"], "{budget}");
        assert_eq!(r.resident_bytes + r.host_bytes + r.disk_bytes, 56 * 4);
        // Served in place but for the tie, kept under another name than
        // its owner's (the stores look owners up): copied to the folder.
        let owner_on_disk = d.plan().device_of(d.layout().id("l0.w").unwrap());
        let copied = if owner_on_disk == Some(&Target::Disk) {
            64
        } else {
            0
        };
        assert_eq!(r.disk_bytes - r.disk_in_place_bytes, copied, "{budget}");
        assert!(r.outside_blocks.is_empty(), "{budget}");
        let fake = budget.starts_with("fake");
        assert_eq!(d.device(), if fake { "fake:0" } else { "cpu" });
        assert_eq!(r.host_bytes > 0, fake && budget.contains("cpu"), "{budget}");
        check_pass(&d, DType::F32);
        check_pass(&d, DType::F32);
    }
}

#[test]
fn a_dtype_override_converts_resident_host_and_disk_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = checkpoint(tmp.path(), None, &[4, 4]);
    for budget in ["cpu=100000", "fake:0=80,cpu=90,disk", "disk"] {
        let off = tmp.path().join(format!("offload-{}", budget.len()));
        let o = DispatchOptions {
            dtype: Some(DType::F16),
            offload_dir: Some(off.clone()),
            ..opts(budget)
        };
        let d = dispatch(&ck, &o).unwrap();
        let r = d.report();
        assert_eq!(r.resident_bytes + r.host_bytes + r.disk_bytes, 56 * 2);
        assert_eq!(r.disk_in_place_bytes, 0, "{budget}");
        if budget == "disk" {
            // The tie's owner is written under its own name.
            assert!(off.join("l0.w.safetensors").exists());
        }
        check_pass(&d, DType::F16);
    }
}

#[test]
fn errors_name_the_tensor_block_or_device() {
    let tmp = tempfile::tempdir().unwrap();
    let all = || opts("cpu=100000");
    let msg = |e: Error| e.to_string();

    let ck = checkpoint(tmp.path(), Some("l1.b"), &[4, 4]);
    let e = dispatch(&ck, &all()).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
    assert!(msg(e).contains("l1.b"));

    let ck = checkpoint(tmp.path(), None, &[4, 5]);
    let e = msg(dispatch(&ck, &all()).unwrap_err());
    assert!(e.contains("l1.w") && e.contains("[4, 5]"), "{e}");

    let ck = checkpoint(tmp.path(), None, &[4, 4]);
    let e = load_and_dispatch(Toy::default(), |_: &_| layout(), &ck, &["nope"], &all());
    assert!(msg(e.unwrap_err()).contains("`nope`"));

    let e = dispatch(&ck, &opts("cuda:0=100000")).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Unsupported);

    // Blocks that leave an offloaded tensor out: reported, and refused on
    // request.
    let d = load_and_dispatch(
        Toy::default(),
        |_: &_| layout(),
        &ck,
        &["l0"],
        &opts("disk"),
    );
    let d = d.unwrap();
    assert_eq!(
        d.report().outside_blocks,
        ["head.w", "l1.b", "l1.w", "l2.b", "l2.w"]
    );
    assert!(msg(d.check_blocks_cover().unwrap_err()).contains("no block covers"));
}
