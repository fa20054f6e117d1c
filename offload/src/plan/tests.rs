use accel_api::{DType, ErrorKind};

use super::place::MaskedMax;
use super::validate::validate;
use super::*;
use crate::layout::{LayoutJson, ModuleJson, TensorJson, LAYOUT_FORMAT};

/// Build a layout from (full tensor name, bytes) in definition order; the
/// optional classes name modules' classes.
fn ordered(tensors: &[(&str, usize)], classes: &[(&str, &str)], tied: &[&[&str]]) -> Layout {
    let mut root = ModuleJson::default();
    for (name, bytes) in tensors {
        let parts: Vec<&str> = name.split('.').collect();
        let mut m = &mut root;
        let mut full = String::new();
        for p in &parts[..parts.len() - 1] {
            full = if full.is_empty() {
                p.to_string()
            } else {
                format!("{full}.{p}")
            };
            let pos = match m.children.iter().position(|c| c.name == *p) {
                Some(i) => i,
                None => {
                    let class = classes
                        .iter()
                        .find(|(n, _)| *n == full)
                        .map(|(_, c)| c.to_string());
                    m.children.push(ModuleJson {
                        name: p.to_string(),
                        class,
                        ..Default::default()
                    });
                    m.children.len() - 1
                }
            };
            m = &mut m.children[pos];
        }
        m.params.push(TensorJson {
            name: parts[parts.len() - 1].to_string(),
            dtype: DType::U8,
            shape: vec![*bytes],
            persistent: true,
        });
    }
    let doc = LayoutJson {
        format: LAYOUT_FORMAT.into(),
        root,
        tied: tied
            .iter()
            .map(|g| g.iter().map(|s| s.to_string()).collect())
            .collect(),
    };
    Layout::from_json(&doc).unwrap()
}

fn opts(spec: &str) -> PlanOptions {
    PlanOptions {
        max_memory: Some(MaxMemory::parse(spec).unwrap()),
        ..Default::default()
    }
}

fn map_of(p: &Plan) -> Vec<(String, String)> {
    p.map
        .iter()
        .map(|(n, d)| (n.clone(), p.devices[*d].device.to_string()))
        .collect()
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

fn tiny() -> Layout {
    ordered(
        &[
            ("embed.weight", 100),
            ("layers.0.w", 100),
            ("layers.1.w", 100),
            ("layers.2.w", 100),
            ("head.weight", 100),
        ],
        &[],
        &[],
    )
}

#[test]
fn max_memory_spec_parses_in_fill_order() {
    let m = MaxMemory::parse("cpu=2GB, disk, cuda:0=40GiB,1=1MiB").unwrap();
    assert_eq!(
        m.devices,
        vec![
            (Target::Accelerator("cuda:0".into()), Some(40 << 30)),
            (Target::Accelerator("cuda:1".into()), Some(1 << 20)),
            (Target::Cpu, Some(2_000_000_000)),
            (Target::Disk, None),
        ]
    );
    for bad in ["cuda:0", "cuda:0=lots", "cpu=1GB,cpu=2GB", "", "gpu 0=1GB"] {
        let e = MaxMemory::parse(bad).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidConfig, "{bad}: {e}");
        assert!(e.to_string().contains("--max-memory"), "{e}");
    }
}

#[test]
fn everything_fitting_merges_to_the_root() {
    let p = plan(&tiny(), &opts("cuda:0=10KB")).unwrap();
    assert_eq!(map_of(&p), pairs(&[("", "cuda:0")]));
    assert_eq!(p.devices[0].used, 500);
    assert_eq!(p.devices[0].tensors, 5);
}

#[test]
fn sequential_fill_with_reserve_split_and_disk_spill() {
    // cuda:0 keeps 100 (largest layer) free: 250 usable -> embed + layers.0.
    // cpu keeps 100 free: 150 usable -> layers.1. The rest spills to disk.
    let p = plan(&tiny(), &opts("cuda:0=350,cpu=250,disk")).unwrap();
    assert_eq!(
        map_of(&p),
        pairs(&[
            ("embed", "cuda:0"),
            ("head", "disk"),
            ("layers.0", "cuda:0"),
            ("layers.1", "cpu"),
            ("layers.2", "disk")
        ])
        .into_iter()
        .collect::<Vec<_>>()
        .tap_sort_by_tree(&tiny())
    );
    assert_eq!(p.devices[0].reserved, 100);
    assert_eq!(p.devices[2].used, 200);
}

trait TapSort {
    fn tap_sort_by_tree(self, l: &Layout) -> Self;
}
impl TapSort for Vec<(String, String)> {
    fn tap_sort_by_tree(mut self, l: &Layout) -> Self {
        self.sort_by_key(|(n, _)| l.id(n).unwrap());
        self
    }
}

#[test]
fn no_disk_means_a_clear_error_naming_the_entry() {
    let e = plan(&tiny(), &opts("cuda:0=350,cpu=250")).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidConfig);
    let s = e.to_string();
    assert!(
        s.contains("`layers.2`") && s.contains("fits on no device") && s.contains("disk"),
        "{s}"
    );
}

#[test]
fn layer_bigger_than_any_gpu() {
    let l = ordered(
        &[
            ("embed.weight", 100),
            ("layers.0.w", 100),
            ("layers.1.w", 1000),
            ("layers.2.w", 100),
            ("head.weight", 100),
        ],
        &[],
        &[],
    );
    // cuda:0 must keep 1000 free, so nothing fits there; cuda:1 (no
    // reservation, as in Accelerate) takes what fits; the big layer and
    // the rest go to cpu.
    let p = plan(&l, &opts("cuda:0=500,cuda:1=500,cpu=2000")).unwrap();
    assert_eq!(
        map_of(&p),
        pairs(&[
            ("embed", "cuda:1"),
            ("layers.0", "cuda:1"),
            ("layers.1", "cpu"),
            ("layers.2", "cpu"),
            ("head", "cpu")
        ])
    );
    assert_eq!(p.devices[0].used, 0);
    // Reserving on every accelerator changes nothing here but is accepted.
    let mut o = opts("cuda:0=500,cuda:1=500,cpu=2000");
    o.reserve = Reserve::EveryAccelerator;
    let p = plan(&l, &o).unwrap();
    assert_eq!(p.devices[1].used, 0);
    // Too small everywhere and no disk: both main devices must keep 1000
    // free, so even the first entry fits nowhere; the error says why.
    let e = plan(&l, &opts("cuda:0=500,cpu=900"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`embed`") && e.contains("kept free for the largest layer"),
        "{e}"
    );
}

fn blocks() -> Layout {
    ordered(
        &[
            ("embed.weight", 100),
            ("layers.0.attn.w", 50),
            ("layers.0.mlp.w", 50),
            ("layers.1.attn.w", 50),
            ("layers.1.mlp.w", 50),
            ("head.weight", 100),
        ],
        &[("layers.0", "Block"), ("layers.1", "Block")],
        &[],
    )
}

#[test]
fn no_split_by_class_and_by_pattern() {
    // Splittable: largest layer 100, cuda:0 usable 150: embed + layers.0.attn.
    let p = plan(&blocks(), &opts("cuda:0=250,cpu=1000")).unwrap();
    assert!(
        map_of(&p).contains(&("layers.0.attn".into(), "cuda:0".into())),
        "{:?}",
        map_of(&p)
    );
    assert!(map_of(&p).contains(&("layers.0.mlp".into(), "cpu".into())));
    for ns in ["Block", "layers.*"] {
        let mut o = opts("cuda:0=250,cpu=1000");
        o.no_split = vec![ns.into()];
        let p = plan(&blocks(), &o).unwrap();
        assert_eq!(
            map_of(&p),
            pairs(&[("embed", "cuda:0"), ("layers", "cpu"), ("head", "cpu")]),
            "no_split {ns}"
        );
    }
}

#[test]
fn tied_weights_are_placed_together() {
    let l = ordered(
        &[
            ("embed.weight", 100),
            ("layers.0.w", 100),
            ("layers.1.w", 100),
            ("layers.2.w", 100),
            ("head.weight", 100),
            ("head.bias", 10),
        ],
        &[],
        &[&["embed.weight", "head.weight"]],
    );
    // embed pulls head along (only its bias costs: the weight is an alias).
    let p = plan(&l, &opts("cuda:0=320,cpu=900")).unwrap();
    assert_eq!(
        map_of(&p),
        pairs(&[
            ("embed", "cuda:0"),
            ("layers.0", "cuda:0"),
            ("layers.1", "cpu"),
            ("layers.2", "cpu"),
            ("head", "cuda:0")
        ])
    );
    assert_eq!(p.devices[0].used, 210);
    assert_eq!(total_size(&l, &PlanOptions::default()), 410);
}

#[test]
fn tied_partner_module_is_split_when_it_is_too_big() {
    let l = ordered(
        &[
            ("embed.weight", 100),
            ("body.w", 100),
            ("decoder.proj.weight", 100),
            ("decoder.big.w", 500),
        ],
        &[],
        &[&["embed.weight", "decoder.proj.weight"]],
    );
    // embed alone fits on cuda:0 (600 - 500 reserved = 100), with the whole
    // decoder it does not: decoder is split and only decoder.proj follows.
    let p = plan(&l, &opts("cuda:0=600,cpu=2000")).unwrap();
    let m = map_of(&p);
    assert!(m.contains(&("embed".into(), "cuda:0".into())), "{m:?}");
    assert!(
        m.contains(&("decoder.proj".into(), "cuda:0".into())),
        "{m:?}"
    );
    assert!(m.contains(&("decoder.big".into(), "cpu".into())), "{m:?}");
}

#[test]
fn balanced_and_balanced_low_0() {
    let l = ordered(
        &[
            ("embed.weight", 100),
            ("layers.0.w", 100),
            ("layers.1.w", 100),
            ("layers.2.w", 100),
            ("layers.3.w", 100),
            ("head.weight", 100),
        ],
        &[],
        &[],
    );
    let mut o = opts("cuda:0=1000,cuda:1=1000");
    o.strategy = Strategy::Balanced;
    let p = plan(&l, &o).unwrap();
    // 600/2 + 1.25 × mean leaf (100) = 425 on cuda:0, minus 100 reserved.
    assert_eq!(p.devices[0].budget, Some(425));
    assert_eq!(p.devices[0].used, 300);
    assert_eq!(p.devices[1].used, 300);
    o.strategy = Strategy::BalancedLow0;
    let p = plan(&l, &o).unwrap();
    assert_eq!(p.devices[0].budget, Some(0));
    assert_eq!(map_of(&p), pairs(&[("", "cuda:1")]));
}

#[test]
fn dtype_override_narrows_floats_only() {
    let doc: LayoutJson = serde_json::from_str(
        r#"{"format":"accel-layout/1","root":{"children":[
        {"name":"a","params":[{"name":"w","dtype":"f32","shape":[10]}],"buffers":[{"name":"ids","dtype":"i64","shape":[10]}]},
        {"name":"b","params":[{"name":"w","dtype":"f16","shape":[10]}]}]}}"#,
    )
    .unwrap();
    let l = Layout::from_json(&doc).unwrap();
    let mut o = PlanOptions {
        dtype: Some(DType::F16),
        ..Default::default()
    };
    assert_eq!(total_size(&l, &o), 20 + 80 + 20);
    o.dtype = Some(DType::F64);
    assert_eq!(total_size(&l, &o), 40 + 80 + 20);
    o.special_dtypes.insert("b.w".into(), DType::F32);
    assert_eq!(total_size(&l, &o), 40 + 80 + 40);
    o.max_memory = Some(MaxMemory::parse("cpu=1000").unwrap());
    o.dtype = Some(DType::BF16);
    let p = plan(&l, &o).unwrap();
    assert_eq!(p.dtype_of(l.id("a.w").unwrap()), Some(DType::BF16));
    assert_eq!(p.dtype_of(l.id("a.ids").unwrap()), Some(DType::I64));
}

#[test]
fn validation_catches_lost_and_doubled_tensors() {
    let l = tiny();
    let o = opts("cuda:0=350,cpu=250,disk");
    let good = plan(&l, &o).unwrap();
    let s = compute_sizes(&l, &o);
    let mut lost = good.clone();
    let head = l.id("head").unwrap();
    lost.map.retain(|(n, _)| n != "head");
    lost.entries.retain(|&(i, _)| i != head);
    let e = validate(&l, &s, &lost).unwrap_err().to_string();
    assert!(e.contains("`head.weight` is not placed"), "{e}");
    let mut twice = good.clone();
    twice.map.push(("layers.2.w".into(), 2));
    twice.entries.push((l.id("layers.2.w").unwrap(), 2));
    assert!(validate(&l, &s, &twice)
        .unwrap_err()
        .to_string()
        .contains("placed twice"));
    let mut over = good;
    over.devices[1].budget = Some(10);
    assert!(validate(&l, &s, &over)
        .unwrap_err()
        .to_string()
        .contains("over its budget"));
}

#[test]
fn largest_layer_respects_no_split() {
    let (size, names) = largest_layer(&blocks(), &PlanOptions::default());
    assert_eq!(
        (size, names),
        (100, vec!["embed".to_string(), "head".to_string()])
    );
    let o = PlanOptions {
        no_split: vec!["Block".into()],
        ..Default::default()
    };
    assert_eq!(largest_layer(&blocks(), &o).1.len(), 4);
}

fn no_reserve(spec: &str) -> PlanOptions {
    PlanOptions {
        reserve: Reserve::None,
        ..opts(spec)
    }
}

#[test]
fn tied_partners_are_split_in_sorted_name_order() {
    // The model defines `z_dec` before `a_dec`; both hold an alias of
    // `embed.weight`. Accelerate sorts a tied group by name, so when
    // `embed` does not fit with both partner modules it splits `a_dec`
    // first (tree order would split `z_dec`).
    let l = ordered(
        &[
            ("embed.weight", 100),
            ("z_dec.proj.weight", 100),
            ("z_dec.big.w", 300),
            ("a_dec.proj.weight", 100),
            ("a_dec.big.w", 300),
        ],
        &[],
        &[&["embed.weight", "z_dec.proj.weight", "a_dec.proj.weight"]],
    );
    let p = plan(&l, &no_reserve("cuda:0=450,cpu=5000")).unwrap();
    assert_eq!(
        map_of(&p),
        pairs(&[
            ("embed", "cuda:0"),
            ("z_dec", "cuda:0"),
            ("a_dec.proj", "cuda:0"),
            ("a_dec.big", "cpu"),
        ])
    );
}

#[test]
fn tied_copy_absent_from_the_checkpoint_and_sorting_first_is_counted_once() {
    // Hugging Face saves `lm_head.weight` (tied to the embedding) once,
    // under the embedding's name. The copy is added as an alias; its bytes
    // must be counted exactly once wherever the group lands, for every
    // budget (this used to undercount and fail validation).
    let mut names: Vec<(String, accel_api::TensorMeta)> = vec![(
        "model.embed_tokens.weight".into(),
        accel_api::TensorMeta {
            dtype: DType::F32,
            shape: vec![64, 16],
        },
    )];
    for i in 0..4 {
        names.push((
            format!("model.layers.{i}.w"),
            accel_api::TensorMeta {
                dtype: DType::F32,
                shape: vec![16, 32],
            },
        ));
    }
    // `lm_head` now sorts last in the inferred order; `a_head` still sorts
    // before its owner.
    for copy in ["lm_head.weight", "a_head.weight"] {
        tied_copy_case(names.clone(), copy);
    }
}

fn tied_copy_case(names: Vec<(String, accel_api::TensorMeta)>, copy: &str) {
    let tied = vec![vec![
        "model.embed_tokens.weight".to_string(),
        copy.to_string(),
    ]];
    let l = Layout::from_tensors(names, &tied).unwrap();
    let total = total_size(&l, &PlanOptions::default());
    assert_eq!(total, 64 * 16 * 4 + 4 * 16 * 32 * 4);
    for kib in [2u64, 4, 6, 8, 10, 12, 16, 20, 40] {
        for spec in [
            format!("cuda:0={kib}KiB,cpu={kib}KiB,disk"),
            format!("cuda:0={kib}KiB,disk"),
        ] {
            let p = plan(&l, &opts(&spec)).unwrap_or_else(|e| panic!("{spec}: {e}"));
            let used: u64 = p.devices.iter().map(|d| d.used).sum();
            assert_eq!(used, total, "{spec}");
            let e = l.id("model.embed_tokens.weight").unwrap();
            let h = l.id(copy).unwrap();
            assert_eq!(p.device_of(e), p.device_of(h), "{spec}");
        }
    }
}

fn fallback_layout() -> Layout {
    ordered(
        &[
            ("embed.weight", 500),
            ("layers.0.w", 50),
            ("layers.1.w", 600),
            ("layers.2.w", 50),
            ("head.weight", 10),
        ],
        &[],
        &[],
    )
}

#[test]
fn reservation_leaving_a_device_empty_is_explained() {
    // cuda:0 keeps 600 (layers.1) free: 400 usable, embed needs 500.
    let p = plan(&fallback_layout(), &opts("cuda:0=1000,cpu=5000")).unwrap();
    assert_eq!(map_of(&p), pairs(&[("", "cpu")]));
    let d = &p.devices[0];
    assert_eq!(d.used, 0);
    assert_eq!(d.min_needed, Some(1100));
    let why = d.empty_reason.as_deref().unwrap();
    assert!(
        why.contains("kept free for the largest layer")
            && why.contains("`layers.1`")
            && why.contains("`embed`")
            && why.contains("--fallback-allocation"),
        "{why}"
    );
    assert!(p.devices[1].empty_reason.is_none());
}

#[test]
fn fallback_allocation_puts_a_later_module_on_the_emptied_device() {
    let mut o = opts("cuda:0=1000,cpu=5000");
    o.fallback_allocation = true;
    let p = plan(&fallback_layout(), &o).unwrap();
    // As Accelerate: the first module further on that fits in
    // 1000 - max(600, 500) is layers.0 (found by splitting `layers`).
    assert_eq!(
        map_of(&p),
        pairs(&[
            ("embed", "cpu"),
            ("layers.0", "cuda:0"),
            ("layers.1", "cpu"),
            ("layers.2", "cpu"),
            ("head", "cpu"),
        ])
    );
    assert_eq!(p.devices[0].used, 50);
    assert!(p.devices[0].empty_reason.is_none());
    // Nothing small enough: the device stays empty, with the reason.
    let l = ordered(&[("embed.weight", 500), ("layers.0.w", 600)], &[], &[]);
    let p = plan(&l, &o).unwrap();
    assert_eq!(p.devices[0].used, 0);
    assert!(p.devices[0].empty_reason.is_some());
}

#[test]
fn balanced_leaves_ignore_tensorless_children() {
    // transformers 5's MixtralExperts: fused expert weights plus an
    // `act_fn` child without tensors. Accelerate's get_balanced_memory
    // counts `experts` as a leaf: mean leaf (100 + 300 + 100) / 3 = 166,
    // buffer 1.25 x 166 = 207, so 500 / 2 + 207 = 457 per accelerator
    // (without the rule: leaves embed and head only, 250 + 125 = 375).
    let doc: LayoutJson = serde_json::from_str(
        r#"{"format":"accel-layout/1","root":{"children":[
        {"name":"embed","params":[{"name":"w","dtype":"u8","shape":[100]}]},
        {"name":"experts","class":"MixtralExperts","params":[{"name":"w1","dtype":"u8","shape":[300]}],
         "children":[{"name":"act_fn","class":"SiLU"}]},
        {"name":"head","params":[{"name":"w","dtype":"u8","shape":[100]}]}]}}"#,
    )
    .unwrap();
    let l = Layout::from_json(&doc).unwrap();
    let mut o = opts("cuda:0=1000,cuda:1=1000");
    o.strategy = Strategy::Balanced;
    let p = plan(&l, &o).unwrap();
    assert_eq!(p.devices[0].budget, Some(457));
}

#[test]
fn an_explicit_disk_budget_takes_the_rest_as_in_accelerate() {
    // Accelerate's infer_auto_device_map ignores a disk budget: disk takes
    // whatever the other devices leave. The budget stays in the plan.
    let p = plan(&tiny(), &opts("cuda:0=350,cpu=250,disk=150")).unwrap();
    let disk = &p.devices[2];
    assert_eq!((disk.max, disk.budget), (Some(150), None));
    assert_eq!(
        disk.used, 200,
        "over the 150 given, as Accelerate places it"
    );
    let e = plan(&tiny(), &opts("cuda:0=350,cpu=250"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("add `disk`"), "{e}");
}

#[test]
fn accelerators_fill_in_number_order_whatever_the_key_order() {
    // Accelerate's get_max_memory sorts the GPU numbers, then cpu, disk:
    // cuda:0 is the main device (it keeps the largest layer free).
    let given = MaxMemory::parse("cpu=1000,cuda:1=150,cuda:0=300,disk").unwrap();
    let order: Vec<String> = given.devices.iter().map(|d| d.0.to_string()).collect();
    assert_eq!(order, ["cuda:0", "cuda:1", "cpu", "disk"]);
    let two_digits = MaxMemory::parse("cuda:10=1,cuda:9=1,cuda:2=1").unwrap();
    let order: Vec<String> = two_digits.devices.iter().map(|d| d.0.to_string()).collect();
    assert_eq!(order, ["cuda:2", "cuda:9", "cuda:10"]);
    // A MaxMemory built in another order is planned in this one.
    let mut o = opts("cuda:0=300,cuda:1=150,cpu=1000,disk");
    let want = map_of(&plan(&tiny(), &o).unwrap());
    o.max_memory.as_mut().unwrap().devices.reverse();
    assert_eq!(map_of(&plan(&tiny(), &o).unwrap()), want);
}

#[test]
fn fallback_allocation_needs_a_budget_above_the_reservation() {
    // cuda:0 = 500 is below the 600 kept for layers.1: Accelerate's limit
    // (500 - 600) is negative, so not even `act_fn`, a module of 0 bytes,
    // is moved up; the device stays empty (Accelerate 1.15 gives this map).
    let doc: LayoutJson = serde_json::from_str(
        r#"{"format":"accel-layout/1","root":{"children":[
        {"name":"embed","params":[{"name":"w","dtype":"u8","shape":[700]}]},
        {"name":"layers","children":[
          {"name":"0","params":[{"name":"w","dtype":"u8","shape":[600]}],
           "children":[{"name":"act_fn","class":"SiLU"}]},
          {"name":"1","params":[{"name":"w","dtype":"u8","shape":[600]}]}]}]}}"#,
    )
    .unwrap();
    let l = Layout::from_json(&doc).unwrap();
    let mut o = opts("cuda:0=500,cpu=5000");
    o.fallback_allocation = true;
    let p = plan(&l, &o).unwrap();
    assert_eq!(map_of(&p), pairs(&[("", "cpu")]));
}

#[test]
fn device_map_serialises_in_module_order() {
    let names: Vec<String> = (0..12).map(|i| format!("h.{i}.w")).collect();
    let mut t: Vec<(&str, usize)> = vec![("wte.weight", 100)];
    t.extend(names.iter().map(|n| (n.as_str(), 100)));
    let l = ordered(&t, &[], &[]);
    let p = plan(&l, &no_reserve("cuda:0=650,cpu=5000")).unwrap();
    let text = serde_json::to_string(&p.device_map()).unwrap();
    let keys: Vec<&str> = text.split('"').skip(1).step_by(4).collect();
    assert_eq!(
        keys,
        [
            "wte", "h.0", "h.1", "h.2", "h.3", "h.4", "h.5", "h.6", "h.7", "h.8", "h.9", "h.10",
            "h.11"
        ]
        .iter()
        .take(keys.len())
        .copied()
        .collect::<Vec<_>>(),
        "{text}"
    );
    assert!(text.find("\"h.2\"").unwrap() < text.find("\"h.10\"").unwrap());
}

#[test]
fn masked_max_agrees_with_a_plain_scan() {
    // Deterministic pseudo-random ranges masked and unmasked, checked
    // against recomputing the maximum over the unmasked values.
    let vals: Vec<u64> = (0..37u64).map(|i| (i * 7919) % 13).collect();
    let mut t = MaskedMax::new(vals.clone());
    let mut mask = vec![0i32; vals.len()];
    let mut active: Vec<std::ops::Range<usize>> = vec![];
    let mut x = 12345u64;
    let mut next = |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    for _ in 0..400 {
        if active.is_empty() || next(3) > 0 {
            let a = next(vals.len() as u64) as usize;
            let b = a + next((vals.len() - a) as u64 + 1) as usize;
            t.mask(a..b, 1);
            mask[a..b].iter_mut().for_each(|m| *m += 1);
            active.push(a..b);
        } else {
            let r = active.swap_remove(next(active.len() as u64) as usize);
            t.mask(r.clone(), -1);
            mask[r].iter_mut().for_each(|m| *m -= 1);
        }
        let want = (0..vals.len())
            .filter(|&i| mask[i] == 0)
            .map(|i| vals[i])
            .max()
            .unwrap_or(0);
        assert_eq!(t.max(), want);
        let mut got = vec![];
        if want > 0 {
            t.each_equal(want, &mut |k| got.push(k));
        }
        let expect: Vec<usize> = (0..vals.len())
            .filter(|&i| want > 0 && mask[i] == 0 && vals[i] == want)
            .collect();
        assert_eq!(got, expect);
        assert_eq!(t.first_max(), expect.first().copied());
    }
}
