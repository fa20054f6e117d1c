//! Generate a sharded checkpoint, plan it over cuda/cpu/disk, load it,
//! verify every tensor by checksum where the plan put it, then run the
//! layers with and without prefetch.

use std::collections::HashMap;

use accel_api::{DType, ErrorKind, OffloadStore};
use accel_offload::exec::{run_layers, LayerSpec, WeightSource};
use accel_offload::layout::Layout;
use accel_offload::load::{load_checkpoint, LoadProgress};
use accel_offload::plan::{plan, MaxMemory, PlanOptions, Target};
use accel_offload::safetensors::Checkpoint;
use accel_offload::store::{DiskStore, HostStore};
use accel_offload::synth::{llama_layout, write_checkpoint, LlamaShape};
use accel_offload::util::checksum;

fn layers_of(layout: &Layout, n: usize) -> Vec<LayerSpec> {
    let mut names = vec!["model.embed_tokens".to_string()];
    names.extend((0..n).map(|i| format!("model.layers.{i}")));
    names.push("model.norm".into());
    names.push("lm_head".into());
    names
        .iter()
        .map(|m| LayerSpec::module(layout, m).unwrap())
        .collect()
}

#[test]
fn checkpoint_plan_load_execute() {
    let shape = LlamaShape::tiny(6, 0);
    let src_layout = llama_layout(shape, DType::F32);
    let dir = tempfile::tempdir().unwrap();
    let ck_dir = dir.path().join("ckpt");
    let sums: HashMap<String, u64> = write_checkpoint(&src_layout, &ck_dir, 16 << 10)
        .unwrap()
        .into_iter()
        .collect();
    let ck = Checkpoint::open(&ck_dir).unwrap();
    assert!(ck.shards.len() >= 3, "{} shards", ck.shards.len());
    // Rebuild the layout from the checkpoint alone (lm_head is tied and
    // absent from the files, as Hugging Face saves it).
    let tied = vec![vec![
        "model.embed_tokens.weight".to_string(),
        "lm_head.weight".to_string(),
    ]];
    let layout = Layout::from_checkpoint(&ck, &tied).unwrap();
    assert_eq!(layout.tensor_count(), src_layout.tensor_count());
    let total = ck.total_bytes();
    let opts = PlanOptions {
        max_memory: Some(
            MaxMemory::parse(&format!("cuda:0={},cpu={},disk", total / 3, total / 3)).unwrap(),
        ),
        no_split: vec!["model.layers.*".into()],
        ..Default::default()
    };
    let p = plan(&layout, &opts).unwrap();
    assert!(p.devices.iter().all(|d| d.tensors > 0), "{:?}", p.devices);

    let gpu = HostStore::new();
    let cpu = HostStore::new();
    let disk = DiskStore::open(&dir.path().join("offload")).unwrap();
    let stores: HashMap<Target, &dyn OffloadStore> = [
        (
            Target::Accelerator("cuda:0".into()),
            &gpu as &dyn OffloadStore,
        ),
        (Target::Cpu, &cpu as &dyn OffloadStore),
        (Target::Disk, &disk as &dyn OffloadStore),
    ]
    .into_iter()
    .collect();
    let mut reports: Vec<LoadProgress> = vec![];
    let rep = load_checkpoint(&ck, &layout, &p, &stores, &mut |pr| {
        reports.push(pr.clone())
    })
    .unwrap();
    assert_eq!(rep.tensors, ck.len());
    assert_eq!(rep.bytes, total);
    assert!(reports.last().unwrap().done);

    // Every owned tensor is in exactly its planned store, bytes intact.
    let mut found = 0;
    for id in layout.tensor_ids() {
        let n = layout.node(id);
        if n.alias_of().is_some() {
            assert!(
                stores.values().all(|s| !s.contains(n.name())),
                "alias {} stored",
                n.name()
            );
            continue;
        }
        let dev = p.device_of(id).unwrap();
        for (t, s) in &stores {
            assert_eq!(
                s.contains(n.name()),
                t == dev,
                "{} on {t}, planned {dev}",
                n.name()
            );
        }
        assert_eq!(
            checksum(&stores[dev].get(n.name()).unwrap()),
            sums[n.name()],
            "{}",
            n.name()
        );
        found += 1;
    }
    assert_eq!(found, sums.len());

    // Execute with and without prefetch: the compute step sees every
    // tensor's right bytes, the tied weight is uploaded once.
    let src = WeightSource::new(&layout, &p, stores.clone());
    let layers = layers_of(&layout, shape.layers);
    for lookahead in [0, 1, 3] {
        let mut seen = 0usize;
        let stats = run_layers(
            &src,
            &layers,
            lookahead,
            |_, _, b: &[u8]| Ok(b.to_vec()),
            |r| {
                for (name, meta, buf) in r.tensors() {
                    let owner = src.owner(name).unwrap();
                    assert_eq!(buf.len(), meta.byte_len());
                    assert_eq!(checksum(buf), sums[owner], "{name}");
                    seen += 1;
                }
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(seen, layout.tensor_count(), "lookahead {lookahead}");
        assert_eq!(stats.layers, layers.len());
        assert_eq!(stats.tied_uploads, 1);
    }

    // A failing compute step stops the run with its error, without hanging.
    let e = run_layers(
        &src,
        &layers,
        2,
        |_, _, b: &[u8]| Ok(b.len()),
        |r| {
            if r.index == 2 {
                Err(accel_api::Error::new(ErrorKind::Backend, "boom"))
            } else {
                Ok(())
            }
        },
    )
    .unwrap_err();
    assert_eq!(e.message(), "boom");
}

#[test]
fn load_with_dtype_override_converts_floats() {
    let layout = llama_layout(LlamaShape::tiny(1, 2), DType::F32);
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(&layout, dir.path(), 1 << 20).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let opts = PlanOptions {
        max_memory: Some(MaxMemory::parse("cpu=1GiB").unwrap()),
        dtype: Some(DType::F16),
        ..Default::default()
    };
    let p = plan(&layout, &opts).unwrap();
    let cpu = HostStore::new();
    let stores: HashMap<Target, &dyn OffloadStore> = [(Target::Cpu, &cpu as &dyn OffloadStore)]
        .into_iter()
        .collect();
    load_checkpoint(&ck, &layout, &p, &stores, &mut |_| {}).unwrap();
    assert_eq!(cpu.bytes() * 2, ck.total_bytes());
    assert_eq!(cpu.meta("model.norm.weight").unwrap().dtype, DType::F16);
    assert_eq!(p.devices[0].used, cpu.bytes());
}

#[test]
fn load_rejects_a_checkpoint_missing_a_planned_tensor() {
    let layout = llama_layout(LlamaShape::tiny(2, 0), DType::F32);
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(&layout, dir.path(), 1 << 20).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    // Plan a layout with one more tensor than the checkpoint has.
    let mut doc = layout.to_json();
    doc.root.children[1]
        .params
        .push(accel_offload::layout::TensorJson {
            name: "bias".into(),
            dtype: DType::F32,
            shape: vec![4],
            persistent: true,
        });
    let bigger = Layout::from_json(&doc).unwrap();
    let p = plan(
        &bigger,
        &PlanOptions {
            max_memory: Some(MaxMemory::parse("cpu=1GiB").unwrap()),
            ..Default::default()
        },
    )
    .unwrap();
    let cpu = HostStore::new();
    let stores: HashMap<Target, &dyn OffloadStore> = [(Target::Cpu, &cpu as &dyn OffloadStore)]
        .into_iter()
        .collect();
    let e = load_checkpoint(&ck, &bigger, &p, &stores, &mut |_| {}).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("lm_head.bias"), "{e}");
}

#[test]
fn non_persistent_buffers_are_planned_but_not_loaded() {
    // A rotary `inv_freq` buffer: in no checkpoint, but it takes memory on
    // its device, so the plan counts it (as Accelerate does).
    let layout = llama_layout(LlamaShape::tiny(2, 0), DType::F32);
    let mut doc = layout.to_json();
    doc.root.children[0]
        .children
        .push(accel_offload::layout::ModuleJson {
            name: "rotary_emb".into(),
            buffers: vec![accel_offload::layout::TensorJson {
                name: "inv_freq".into(),
                dtype: DType::F32,
                shape: vec![1000],
                persistent: false,
            }],
            ..Default::default()
        });
    let with_buf = Layout::from_json(&doc).unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(&with_buf, dir.path(), 1 << 20).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(
        ck.len(),
        layout.tensor_count() - 1,
        "lm_head is tied, inv_freq not stored"
    );
    let opts = PlanOptions {
        max_memory: Some(MaxMemory::parse("cpu=1GiB").unwrap()),
        ..Default::default()
    };
    let p = plan(&with_buf, &opts).unwrap();
    assert_eq!(p.devices[0].used, ck.total_bytes() + 4000);
    let cpu = HostStore::new();
    let stores: HashMap<Target, &dyn OffloadStore> = [(Target::Cpu, &cpu as &dyn OffloadStore)]
        .into_iter()
        .collect();
    load_checkpoint(&ck, &with_buf, &p, &stores, &mut |_| {}).unwrap();
    assert!(!cpu.contains("model.rotary_emb.inv_freq"));
    let spec = LayerSpec::module(&with_buf, "model").unwrap();
    assert!(!spec.tensors.iter().any(|t| t.ends_with("inv_freq")));
}
