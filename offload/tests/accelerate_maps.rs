//! accel's planner against Accelerate 1.15's `infer_auto_device_map` on
//! generated cases: Llama-shaped models on the meta device (3 sizes, one
//! with tied embeddings, an `act_fn` without tensors in every MLP), 5
//! budget pairs, `max_memory` keys given GPU first, CPU first or with the
//! GPU numbers reversed, with and without an explicit disk budget,
//! `fallback_allocation` on and off, with and without a no-split class:
//! 360 cases, every map equal. The layouts come from
//! `tools/export_layout.py`, as `accel plan --layout` reads them.
//!
//! Needs the torch venv (`make torch-venv`, or `$ACCEL_TORCH_PYTHON`);
//! without it the test prints why and passes, except under CI.

use std::collections::BTreeMap;
use std::path::Path;

use accel_offload::layout::{Layout, LayoutJson};
use accel_offload::plan::{plan, MaxMemory, PlanOptions};

use accel_test_support::python;

const CASES: &str = r#"
import json, sys, itertools, warnings, logging
sys.path.insert(0, sys.argv[1])  # tools/, for export_layout
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
import torch
from torch import nn
from accelerate.utils import infer_auto_device_map
from export_layout import layout_of

class MLP(nn.Module):
    def __init__(s, h, f):
        super().__init__()
        s.gate_proj = nn.Linear(h, f, bias=False)
        s.up_proj = nn.Linear(h, f, bias=False)
        s.down_proj = nn.Linear(f, h, bias=False)
        s.act_fn = nn.SiLU()

class Attn(nn.Module):
    def __init__(s, h):
        super().__init__()
        s.q_proj = nn.Linear(h, h, bias=False)
        s.k_proj = nn.Linear(h, h, bias=False)
        s.v_proj = nn.Linear(h, h, bias=False)
        s.o_proj = nn.Linear(h, h, bias=False)

class Norm(nn.Module):
    def __init__(s, h):
        super().__init__()
        s.weight = nn.Parameter(torch.ones(h))

class DecoderLayer(nn.Module):
    def __init__(s, h, f):
        super().__init__()
        s.self_attn = Attn(h)
        s.mlp = MLP(h, f)
        s.input_layernorm = Norm(h)
        s.post_attention_layernorm = Norm(h)

class Inner(nn.Module):
    def __init__(s, v, h, f, n):
        super().__init__()
        s.embed_tokens = nn.Embedding(v, h)
        s.layers = nn.ModuleList([DecoderLayer(h, f) for _ in range(n)])
        s.norm = Norm(h)

class CausalLM(nn.Module):
    def __init__(s, v, h, f, n, tie):
        super().__init__()
        s.model = Inner(v, h, f, n)
        s.lm_head = nn.Linear(h, v, bias=False)
        if tie:
            s.lm_head.weight = s.model.embed_tokens.weight

cases = []
for (v, h, f, n, tie) in [(64, 8, 16, 3, False), (32, 8, 24, 2, True), (128, 4, 32, 4, False)]:
    with torch.device("meta"):
        m = CausalLM(v, h, f, n, tie)
    layout = layout_of(m)
    total = sum(p.numel() * 4 for p in m.parameters())
    for frac_gpu, frac_cpu in [(0.15, 2.0), (0.3, 0.3), (0.5, 0.2), (0.25, 0.6), (0.08, 0.5)]:
        g, c = int(total * frac_gpu), int(total * frac_cpu)
        for order in ["gpu_first", "cpu_first", "gpus_reversed"]:
            for fallback in [False, True]:
                for no_split in [[], ["DecoderLayer"]]:
                    for disk in [None, 64]:
                        if order == "gpu_first":
                            mm = [[0, g], ["cpu", c]]
                        elif order == "cpu_first":
                            mm = [["cpu", c], [0, g]]
                        else:
                            mm = [[1, g // 2], [0, g], ["cpu", c]]
                        if disk is not None:
                            mm.append(["disk", disk])
                        try:
                            dm = infer_auto_device_map(m, max_memory={k: b for k, b in mm},
                                no_split_module_classes=no_split, fallback_allocation=fallback)
                        except Exception as e:
                            dm = {"error": str(e)}
                        cases.append({"layout": layout, "max_memory": mm, "fallback": fallback,
                                      "no_split": no_split, "map": {k: (f"cuda:{d}" if isinstance(d, int) else d) for k, d in dm.items()}})
print(json.dumps(cases))
"#;

#[test]
fn device_maps_equal_accelerates_infer_auto_device_map() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let candidates = python::torch_python_candidates(&root);
    let Some(py) = python::python_with(
        candidates,
        &["torch", "accelerate"],
        "`make torch-venv` makes one",
    ) else {
        return;
    };
    let out = python::run_python(&py, CASES, &[&root.join("tools")]);
    let cases: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(cases.len(), 360);
    let mut wrong = vec![];
    for (i, c) in cases.iter().enumerate() {
        let doc: LayoutJson = serde_json::from_value(c["layout"].clone()).unwrap();
        let layout = Layout::from_json(&doc).unwrap();
        // Keys in the order given; `disk` appended when absent, as
        // Accelerate appends it (accel uses disk only when listed).
        let mut spec: Vec<String> = vec![];
        for kv in c["max_memory"].as_array().unwrap() {
            let key = match &kv[0] {
                serde_json::Value::Number(n) => format!("cuda:{n}"),
                v => v.as_str().unwrap().to_string(),
            };
            spec.push(format!("{key}={}", kv[1]));
        }
        if !spec.iter().any(|s| s.starts_with("disk")) {
            spec.push("disk".into());
        }
        let spec = spec.join(",");
        let opts = PlanOptions {
            max_memory: Some(MaxMemory::parse(&spec).unwrap()),
            no_split: serde_json::from_value(c["no_split"].clone()).unwrap(),
            fallback_allocation: c["fallback"].as_bool().unwrap(),
            ..Default::default()
        };
        let want: BTreeMap<String, String> = serde_json::from_value(c["map"].clone()).unwrap();
        let got: BTreeMap<String, String> = match plan(&layout, &opts) {
            Ok(p) => p
                .map
                .iter()
                .map(|(n, d)| (n.clone(), p.devices[*d].device.to_string()))
                .collect(),
            Err(e) => BTreeMap::from([("error".to_string(), e.to_string())]),
        };
        if got != want {
            wrong.push(format!(
                "case {i}: --max-memory {spec}, fallback {}, no-split {}\n  Accelerate: {want:?}\n  accel:      {got:?}",
                c["fallback"], c["no_split"]
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} maps differ from Accelerate's:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
}
