//! torch's distributed-checkpoint Hugging Face layout (issue 41), both ways
//! and against the real torch 2.13 (`make torch-venv`):
//! - accel writes it (`save_model_sharded`) at 2 and 3 ranks and reads it
//!   back at 1, 2 and 4 (`load_model`);
//! - a checkpoint torch FSDP2 (`fully_shard`, 2 ranks on gloo) saved with
//!   `HuggingFaceStorageWriter(save_distributed=True)` loads into accel at
//!   1, 2 and 4 ranks, equal to torch's own full weights;
//! - what accel wrote at 2 ranks loads into torch (one process) with
//!   `HuggingFaceStorageReader`, equal to the model accel saved;
//! - torch's checkpoint consolidates (`consolidate_model`) into torch's own
//!   full weights and into what torch's own consolidation writes, byte for
//!   byte, and Python's safetensors reads accel's consolidated file with the
//!   names, shapes and dtypes torch gave;
//! - a ZeRO-3 run at 4 ranks saves the layout unit by unit
//!   (`ZeroOptimizer::save_model_sharded`), the same bytes as the
//!   replicated save of its gathered parameters; torch FSDP2 at 2 ranks
//!   loads it (`dcp.load` with `HuggingFaceStorageReader`) equal to accel's
//!   values;
//! - torch's pickled `.metadata` layout, a missing rank's file and
//!   overlapping chunks are refused, naming the file or tensor.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use accel::train::{shard_file_name, ParamMut, ParamRef, Parameters, DCP_SHARDING_INFO};
use accel::ErrorKind;

mod common;
use common::{ranks, single};

/// Named parameters with shapes, as torch's `nn.Sequential(Linear(5, 7),
/// ReLU(), Linear(7, 3))` names them.
#[derive(Clone, Debug, PartialEq)]
struct Mlp(Vec<Param>);

/// A parameter: name, shape, values, gradients.
type Param = (String, Vec<usize>, Vec<f32>, Vec<f32>);

impl Mlp {
    /// Values `seed + i / 8` per parameter, in order.
    fn new(seed: f32) -> Mlp {
        let shapes = [
            ("0.weight", vec![7, 5]),
            ("0.bias", vec![7]),
            ("2.weight", vec![3, 7]),
            ("2.bias", vec![3]),
        ];
        Mlp(shapes
            .into_iter()
            .enumerate()
            .map(|(p, (n, s))| {
                let len: usize = s.iter().product();
                let v = (0..len)
                    .map(|i| seed + p as f32 * 10.0 + i as f32 / 8.0)
                    .collect();
                (n.to_string(), s, v, vec![0.0; len])
            })
            .collect())
    }

    fn values(&self) -> Vec<(String, Vec<f32>)> {
        self.0
            .iter()
            .map(|(n, _, v, _)| (n.clone(), v.clone()))
            .collect()
    }
}

impl Parameters for Mlp {
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        for (n, _, v, g) in &self.0 {
            f(ParamRef::host(n, v, g));
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        for (n, _, v, g) in &mut self.0 {
            f(ParamMut::host(n, v, g));
        }
    }
    fn param_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.0.iter().find(|p| p.0 == name).map(|p| p.1.clone())
    }
}

/// `dir` saved by `world` rank threads from `Mlp::new(1.5)`.
fn save_sharded(dir: &Path, world: usize) {
    let d = dir.to_path_buf();
    ranks(world, move |acc| {
        acc.save_model_sharded(&Mlp::new(1.5), &d).unwrap();
    });
}

/// What `world` ranks load from `dir` (each rank's values).
fn load_on(dir: &Path, world: usize) -> Vec<Vec<(String, Vec<f32>)>> {
    let d = dir.to_path_buf();
    ranks(world, move |acc| {
        let mut m = Mlp::new(0.0);
        acc.load_model(&mut m, &d).unwrap();
        m.values()
    })
}

/// A safetensors file's header metadata and tensors (name, dtype, shape,
/// bytes): what two files must agree on (the metadata's order in the
/// header is a hash map's).
type Contents = (
    std::collections::HashMap<String, String>,
    Vec<(String, String, Vec<usize>, Vec<u8>)>,
);

fn contents(file: &Path) -> Contents {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut t: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                format!("{:?}", v.dtype()),
                v.shape().to_vec(),
                v.data().to_vec(),
            )
        })
        .collect();
    t.sort();
    (header(file), t)
}

/// The header metadata of `file`.
fn header(file: &Path) -> std::collections::HashMap<String, String> {
    let bytes = std::fs::read(file).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata().clone().unwrap_or_default()
}

#[test]
fn accel_writes_per_rank_shards_with_offsets_and_reads_them_at_any_world_size() {
    let tmp = tempfile::tempdir().unwrap();
    for world in [2, 3] {
        let dir = tmp.path().join(format!("w{world}"));
        save_sharded(&dir, world);
        // One file per rank, each with its offsets: rank 1 of 2 holds rows
        // 4..7 of 0.weight (torch's chunking: ceil(7 / 2) = 4).
        for r in 0..world {
            let meta = header(&dir.join(shard_file_name(r)));
            assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
            assert!(meta.contains_key(DCP_SHARDING_INFO), "{meta:?}");
        }
        if world == 2 {
            let info = &header(&dir.join(shard_file_name(1)))[DCP_SHARDING_INFO];
            let info: serde_json::Value = serde_json::from_str(info).unwrap();
            assert_eq!(info["0.weight"]["saved_offsets"], serde_json::json!([4, 0]));
            assert_eq!(info["2.bias"]["saved_offsets"], serde_json::json!([2]));
        }
        let want = Mlp::new(1.5).values();
        for at in [1, 2, 4] {
            for got in load_on(&dir, at) {
                assert_eq!(got, want, "saved at {world}, loaded at {at}");
            }
        }
    }
}

#[test]
fn a_missing_rank_overlapping_chunks_and_torchs_pickle_are_refused_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    save_sharded(&dir, 2);
    let err = |d: &Path| {
        let mut m = Mlp::new(0.0);
        single().load_model(&mut m, d).unwrap_err()
    };
    // Rank 0's file gone: the tensors have a hole.
    let gone = tmp.path().join("gone");
    std::fs::create_dir(&gone).unwrap();
    std::fs::copy(dir.join(shard_file_name(1)), gone.join(shard_file_name(1))).unwrap();
    let e = err(&gone);
    assert_eq!(e.kind(), &ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("a rank's file is missing"), "{e}");
    // The headers alone tell the same (`accel checkpoint verify`).
    let index = |d: &Path| accel::train::dcp_index(d).unwrap().unwrap();
    let whole = index(&dir);
    assert_eq!(whole.world_size(), 2);
    assert_eq!(whole.tensors["0.weight"], [7, 5]);
    assert_eq!(whole.files[1].2[1].offsets, [4, 0], "{whole:?}");
    whole.check().unwrap();
    let e = index(&gone).check().unwrap_err().to_string();
    assert!(
        e.contains("\"0.bias\" [7]: its chunks hold 3 of its 7 elements")
            && e.contains("a rank's file is missing"),
        "{e}"
    );
    // A region across both ranks' chunks reads whole from the two files,
    // and with rank 0's file gone it has a hole.
    let want: Vec<f32> = Mlp::new(1.5).0[0].2[2 * 5..6 * 5].to_vec();
    let rows = accel::train::read_tensor_region(&dir, "0.weight", &[2..6, 0..5]).unwrap();
    assert_eq!(
        (rows.shape.as_slice(), &rows.data),
        (&[4usize, 5][..], &want)
    );
    let e = accel::train::read_tensor_region(&gone, "0.weight", &[2..6, 0..5]).unwrap_err();
    assert!(e.to_string().contains("a rank's file is missing"), "{e}");
    // The last rank's gone: the layout alone cannot tell (torch's reader
    // neither), the model's shape does.
    let last = tmp.path().join("last");
    std::fs::create_dir(&last).unwrap();
    std::fs::copy(dir.join(shard_file_name(0)), last.join(shard_file_name(0))).unwrap();
    let e = err(&last).to_string();
    assert!(
        e.contains("0.weight") && e.contains("[4, 5]") && e.contains("[7, 5]"),
        "{e}"
    );
    // The same rank twice (under another name): chunks overlap.
    let twice = tmp.path().join("twice");
    std::fs::create_dir(&twice).unwrap();
    for (src, dst) in [(0, 0), (1, 1), (0, 2)] {
        std::fs::copy(
            dir.join(shard_file_name(src)),
            twice.join(shard_file_name(dst)),
        )
        .unwrap();
    }
    let e = err(&twice);
    assert!(e.to_string().contains("two chunks of tensor"), "{e}");
    let e = index(&twice).check().unwrap_err().to_string();
    assert!(
        e.contains("overlap") && e.contains(&shard_file_name(2)),
        "{e}"
    );
    // torch's default writer: a pickled .metadata, never read.
    let pickle = tmp.path().join("pickle");
    std::fs::create_dir(&pickle).unwrap();
    std::fs::write(pickle.join(".metadata"), b"\x80\x04pickle").unwrap();
    std::fs::write(pickle.join("__0_0.distcp"), b"data").unwrap();
    let e = err(&pickle);
    assert_eq!(e.kind(), &ErrorKind::Unsupported, "{e}");
    let i = accel::train::dcp_index(&pickle).unwrap_err();
    assert_eq!(i.kind(), &ErrorKind::Unsupported, "{i}");
    let m = e.to_string();
    assert!(
        m.contains(".metadata") && m.contains("HuggingFaceStorageWriter"),
        "{m}"
    );
}

/// torch's Python, with torch and safetensors (`make torch-venv`).
fn torch_python() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    common::python_from(
        common::torch_python_candidates(&root),
        "import torch, safetensors",
        "`make torch-venv` makes one",
    )
}

/// FSDP2 on 2 gloo ranks saves `argv[1]` with torch's Hugging Face writer,
/// and rank 0 the full weights to `argv[2]` (a plain safetensors file).
const TORCH_SAVES: &str = r#"
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.fsdp import fully_shard
from safetensors.torch import save_file

def run(rank, out, full, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(7)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    if rank == 0:
        save_file({k: v.contiguous() for k, v in m.state_dict().items()}, full)
    fully_shard(m)
    dcp.save(m.state_dict(), storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], sys.argv[2], sys.argv[3]), nprocs=2)
"#;

/// One process loads `argv[1]` with torch's Hugging Face reader into the
/// plain model and compares with the full weights in `argv[2]`.
const TORCH_LOADS: &str = r#"
import sys, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from safetensors.torch import load_file
m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
sd = {k: torch.zeros_like(v) for k, v in m.state_dict().items()}
dcp.load(sd, storage_reader=HuggingFaceStorageReader(sys.argv[1]))
want = load_file(sys.argv[2])
for k in want:
    assert torch.equal(sd[k], want[k]), (k, sd[k], want[k])
print("torch loaded", len(sd), "tensors")
"#;

/// torch's own consolidation of `argv[1]` into `argv[2]` (every tensor in
/// one file), then Python's safetensors reads accel's consolidated file
/// `argv[3]`: one line `name dtype shape` per tensor.
const TORCH_CONSOLIDATES: &str = r#"
import glob, os, sys
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
names = set()
for f in glob.glob(os.path.join(sys.argv[1], "*.safetensors")):
    with safe_open(f, "pt") as h:
        names.update(h.keys())
os.makedirs(sys.argv[2], exist_ok=True)
consolidate_safetensors_files(sys.argv[1], sys.argv[2], {n: 1 for n in names})
for n, t in sorted(load_file(sys.argv[3]).items()):
    print(n, str(t.dtype), list(t.shape))
"#;

/// FSDP2 on 2 gloo ranks loads `argv[1]` with torch's Hugging Face reader
/// (`dcp.load` into the sharded state dict) and compares every full tensor
/// with `argv[2]` (a plain safetensors file).
const TORCH_LOADS_SHARDED: &str = r#"
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.fsdp import fully_shard
from safetensors.torch import load_file

def run(rank, ck, full, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=2)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fully_shard(m)
    sd = m.state_dict()
    for v in sd.values():
        v.to_local().zero_()
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(ck))
    want = load_file(full)
    for k, v in sd.items():
        assert torch.equal(v.full_tensor(), want[k]), (k, v.full_tensor(), want[k])
    if rank == 0:
        print("torch loaded", len(sd), "tensors at 2 ranks")
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], sys.argv[2], sys.argv[3]), nprocs=2)
"#;

/// Run Python script `text` (written to `dir/name`) with `args`; its
/// standard output.
fn run_script(py: &Path, dir: &Path, name: &str, text: &str, args: &[&OsStr]) -> String {
    let script = dir.join(name);
    std::fs::write(&script, text).unwrap();
    common::run_python_file(py, &script, args)
}

/// A free loopback port, for torch's rendezvous.
fn free_port() -> String {
    accel_test_support::free_port().to_string()
}

/// ZeRO stage 3 over `world` rank threads: 3 steps of SGD with momentum on
/// `Mlp::new(1.5)` (gradients from the values and the rank), then the
/// layout written unit by unit to `dir`, and the replicated save of the
/// gathered parameters to `dir`-replicated. Returns the gathered values.
fn zero3_saves(dir: &Path, world: usize) -> Vec<(String, Vec<f32>)> {
    use accel::zero::{ShardedSgd, Stage, UnitGate, WrapPolicy, ZeroOptimizer};
    let d = dir.to_path_buf();
    let mut all = ranks(world, move |acc| {
        let mut m = Mlp::new(1.5);
        let opt = ShardedSgd::new(0.1).with_momentum(0.9);
        let mut zero = ZeroOptimizer::new(
            acc.comm().clone(),
            &m,
            Stage::Full,
            &WrapPolicy::Depth(1),
            opt,
        )
        .unwrap();
        assert!(zero.plan().units().len() > 1, "more than one unit");
        for _ in 0..3 {
            zero.gather(&mut m, "").unwrap();
            for (_, _, v, g) in &mut m.0 {
                for (g, v) in g.iter_mut().zip(v.iter()) {
                    *g = *v * 0.25 + acc.rank() as f32 * 0.01;
                }
            }
            zero.reduce_grads(&mut m, "").unwrap();
            zero.step(&mut m).unwrap();
        }
        zero.save_model_sharded(&acc, &m, &d).unwrap();
        let full = zero.full_parameters(&m).unwrap();
        acc.save_model_sharded(&full, d.with_extension("replicated"))
            .unwrap();
        full.params
    });
    let first = all.remove(0);
    assert!(
        all.iter().all(|p| *p == first),
        "every rank gathers the same"
    );
    first
}

#[test]
fn a_zero3_run_saves_unit_by_unit_what_the_replicated_save_writes_and_loads_anywhere() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("zero3");
    let full = zero3_saves(&dir, 4);
    assert_ne!(full, Mlp::new(1.5).values(), "the steps moved the values");
    for rank in 0..4 {
        let f = shard_file_name(rank);
        assert_eq!(
            contents(&dir.join(&f)),
            contents(&dir.with_extension("replicated").join(&f)),
            "{f}"
        );
    }
    for at in [1, 3] {
        for got in load_on(&dir, at) {
            assert_eq!(got, full, "loaded at {at} rank(s)");
        }
    }
}

#[test]
fn torch_fsdp2s_checkpoint_loads_into_accel_and_accels_into_torch() {
    let Some(py) = torch_python() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (out, full) = (
        tmp.path().join("torch"),
        tmp.path().join("full.safetensors"),
    );
    let port = free_port();
    let args = [out.as_os_str(), full.as_os_str(), port.as_ref()];
    run_script(&py, tmp.path(), "save.py", TORCH_SAVES, &args);
    // torch's full weights, by name.
    let bytes = std::fs::read(&full).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut want: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            let data = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (n, data)
        })
        .collect();
    want.sort_by(|a, b| a.0.cmp(&b.0));
    for at in [1, 2, 4] {
        for mut got in load_on(&out, at) {
            got.sort_by(|a, b| a.0.cmp(&b.0));
            assert_eq!(got, want, "torch's 2 shards loaded at {at} rank(s)");
        }
    }
    // Consolidated: torch's own full file, tensor for tensor (names,
    // element type, shape, bytes).
    let cons = tmp.path().join("consolidated");
    accel::train::consolidate_model(&out, &cons, accel::train::DEFAULT_MAX_SHARD_SIZE).unwrap();
    let ours = std::fs::read(cons.join("model.safetensors")).unwrap();
    let ours = safetensors::SafeTensors::deserialize(&ours).unwrap();
    assert_eq!(ours.len(), st.len());
    for (n, v) in st.tensors() {
        let o = ours.tensor(&n).unwrap();
        assert_eq!(
            (o.dtype(), o.shape(), o.data()),
            (v.dtype(), v.shape(), v.data()),
            "{n}"
        );
    }
    // torch's own consolidation, tensor for tensor; Python reads ours.
    let tcons = tmp.path().join("torch-consolidated");
    let cons_file = cons.join("model.safetensors");
    let args = [out.as_os_str(), tcons.as_os_str(), cons_file.as_os_str()];
    let printed = run_script(&py, tmp.path(), "consolidate.py", TORCH_CONSOLIDATES, &args);
    let theirs = std::fs::read(tcons.join("model-00001-of-00001.safetensors")).unwrap();
    let theirs = safetensors::SafeTensors::deserialize(&theirs).unwrap();
    assert_eq!(theirs.len(), ours.len());
    let mut seen = Vec::new();
    for (n, v) in theirs.tensors() {
        let o = ours.tensor(&n).unwrap();
        assert_eq!(
            (o.dtype(), o.shape(), o.data()),
            (v.dtype(), v.shape(), v.data()),
            "{n}"
        );
        seen.push(format!("{n} torch.float32 {:?}", v.shape()));
    }
    seen.sort();
    let read: Vec<&str> = printed.lines().collect();
    assert_eq!(read, seen, "{printed}");
    // The other way: accel's shards at 2 ranks, torch's reader, compared
    // with the model save_model writes whole.
    let ours = tmp.path().join("accel");
    save_sharded(&ours, 2);
    let whole = tmp.path().join("whole");
    single()
        .save_model(&Mlp::new(1.5), &whole, accel::train::DEFAULT_MAX_SHARD_SIZE)
        .unwrap();
    let whole_file = whole.join("model.safetensors");
    let args = [ours.as_os_str(), whole_file.as_os_str()];
    let printed = run_script(&py, tmp.path(), "load.py", TORCH_LOADS, &args);
    assert!(printed.contains("torch loaded 4 tensors"), "{printed}");
    // A ZeRO-3 run at 4 ranks, loaded by torch FSDP2 at 2.
    let zero3 = tmp.path().join("zero3");
    let values = zero3_saves(&zero3, 4);
    let mut model = Mlp::new(0.0);
    for (p, (_, v)) in model.0.iter_mut().zip(values) {
        p.2 = v;
    }
    let want = tmp.path().join("zero3-whole");
    single()
        .save_model(&model, &want, accel::train::DEFAULT_MAX_SHARD_SIZE)
        .unwrap();
    let (want_file, port) = (want.join("model.safetensors"), free_port());
    let args = [zero3.as_os_str(), want_file.as_os_str(), port.as_ref()];
    let printed = run_script(
        &py,
        tmp.path(),
        "load_sharded.py",
        TORCH_LOADS_SHARDED,
        &args,
    );
    assert!(
        printed.contains("torch loaded 4 tensors at 2 ranks"),
        "{printed}"
    );
}
