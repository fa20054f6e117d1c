//! Bounded fuzzing of accel-offload's input parsers, through their public
//! entries: safetensors headers (`safetensors::parse_header`, and whole
//! files through `read_header` / `SafetensorsFile::open`), layout JSON
//! (`Layout::from_json` / `from_json_file`, then the planner on what
//! loaded), and memory sizes (`util::parse_size`, `MaxMemory::parse`).
//! Inputs are arbitrary bytes and structure-aware mutations of valid
//! inputs; the properties are "no panic" plus what a successful parse
//! promises.
//!
//! `ACCEL_FUZZ_SECONDS=600 cargo test -p accel-offload --test fuzz_inputs
//! -- --test-threads=1 --nocapture` runs each property for that long.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use accel_api::DType;
use accel_offload::layout::{Layout, LayoutJson};
use accel_offload::plan::{self, MaxMemory, PlanOptions, Target};
use accel_offload::safetensors::{self, SafetensorsFile};
use accel_offload::util::parse_size;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::{json, Value};

use accel_test_support::fuzz::budget;

// ------------------------------------------------------------ mutations

/// Byte-level edits of a valid text (JSON, size strings).
#[derive(Debug, Clone)]
enum ByteEdit {
    Flip(usize, u8),
    Set(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
}

fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    // Bytes that matter to JSON and to number parsers.
    let interesting = prop_oneof![
        any::<u8>(),
        proptest::sample::select(b"{}[]\",:.-+eE0123456789 \\nul".to_vec()),
    ];
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(i, b)| ByteEdit::Flip(i, b)),
        (any::<usize>(), interesting).prop_map(|(i, b)| ByteEdit::Set(i, b)),
        any::<usize>().prop_map(ByteEdit::Truncate),
        (any::<usize>(), vec(any::<u8>(), 1..8)).prop_map(|(i, b)| ByteEdit::Insert(i, b)),
        (any::<usize>(), 1usize..6).prop_map(|(i, n)| ByteEdit::Remove(i, n)),
    ]
}

fn edit(mut p: Vec<u8>, edits: &[ByteEdit]) -> Vec<u8> {
    for e in edits {
        let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
        match e {
            ByteEdit::Flip(i, b) if !p.is_empty() => {
                let i = at(*i, p.len());
                p[i] ^= 1 << b;
            }
            ByteEdit::Set(i, b) if !p.is_empty() => {
                let i = at(*i, p.len());
                p[i] = *b;
            }
            ByteEdit::Truncate(i) => {
                let i = at(*i, p.len() + 1);
                p.truncate(i);
            }
            ByteEdit::Insert(i, b) => {
                let i = at(*i, p.len() + 1);
                p.splice(i..i, b.iter().copied());
            }
            ByteEdit::Remove(i, n) if !p.is_empty() => {
                let i = at(*i, p.len());
                let end = (i + n).min(p.len());
                p.drain(i..end);
            }
            _ => {}
        }
    }
    p
}

/// Numbers that break arithmetic: zero, one, around 2^32, 2^62, 2^63, 2^64.
fn edge_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..16,
        Just(u64::from(u32::MAX)),
        Just(u64::from(u32::MAX) + 1),
        Just((1u64 << 62) + 1),
        Just(1u64 << 63),
        Just(u64::MAX),
        Just(u64::MAX - 1),
        any::<u64>(),
    ]
}

/// A JSON number that is not a plain u64: negative, fractional, huge.
fn odd_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(-1)),
        Just(json!(1.5)),
        Just(json!(1e300)),
        Just(Value::String("3".into())),
        Just(Value::Null),
        Just(json!(18446744073709551616.0)),
    ]
}

// ------------------------------------------------------------ safetensors

const ST_DTYPES: &[&str] = &[
    "F16", "BF16", "F32", "F64", "I8", "U8", "I32", "I64", "BOOL", "F8_E4M3", "f32", "",
];

/// One tensor of a valid header: a dtype and a shape (offsets are laid out
/// by [`st_header`]).
fn st_tensor() -> impl Strategy<Value = (String, DType, Vec<u64>)> {
    (
        "[a-z]{1,3}(\\.[0-9]{1,2}){0,2}",
        proptest::sample::select(DType::ALL.to_vec()),
        vec(0u64..5, 0..3),
    )
}

/// A valid header JSON for `tensors`, laid out back to back; its data length.
fn st_header(tensors: &[(String, DType, Vec<u64>)]) -> (Value, u64) {
    let mut m = serde_json::Map::new();
    let mut off = 0u64;
    for (name, dt, shape) in tensors {
        let len = shape.iter().product::<u64>() * dt.size() as u64;
        m.insert(
            name.clone(),
            json!({
                "dtype": safetensors::dtype_to_st(*dt),
                "shape": shape,
                "data_offsets": [off, off + len],
            }),
        );
        off += len;
    }
    m.insert("__metadata__".into(), json!({"format": "pt"}));
    (Value::Object(m), off)
}

/// A structural edit of a header: the kind of lie a hostile file tells.
#[derive(Debug, Clone)]
enum HeaderEdit {
    Shape(usize, usize, u64),
    ShapeOdd(usize, Value),
    Offset(usize, usize, u64),
    OffsetOdd(usize, usize, Value),
    Dtype(usize, &'static str),
    DropField(usize, usize),
    Duplicate(usize),
    NotAnObject(usize),
}

fn header_edit() -> impl Strategy<Value = HeaderEdit> {
    prop_oneof![
        (any::<usize>(), any::<usize>(), edge_u64())
            .prop_map(|(t, d, v)| HeaderEdit::Shape(t, d, v)),
        (any::<usize>(), odd_number()).prop_map(|(t, v)| HeaderEdit::ShapeOdd(t, v)),
        (any::<usize>(), 0usize..2, edge_u64()).prop_map(|(t, i, v)| HeaderEdit::Offset(t, i, v)),
        (any::<usize>(), 0usize..2, odd_number())
            .prop_map(|(t, i, v)| HeaderEdit::OffsetOdd(t, i, v)),
        (any::<usize>(), proptest::sample::select(ST_DTYPES.to_vec()))
            .prop_map(|(t, d)| HeaderEdit::Dtype(t, d)),
        (any::<usize>(), 0usize..3).prop_map(|(t, f)| HeaderEdit::DropField(t, f)),
        any::<usize>().prop_map(HeaderEdit::Duplicate),
        any::<usize>().prop_map(HeaderEdit::NotAnObject),
    ]
}

fn apply_header_edit(h: &mut Value, e: &HeaderEdit) {
    let Some(m) = h.as_object_mut() else { return };
    let names: Vec<String> = m.keys().filter(|k| *k != "__metadata__").cloned().collect();
    if names.is_empty() {
        return;
    }
    let pick = |i: usize| names[i % names.len()].clone();
    // A field of a tensor entry, when the entry is still an object.
    fn field<'a>(
        m: &'a mut serde_json::Map<String, Value>,
        t: &str,
        f: &str,
    ) -> Option<&'a mut Value> {
        m.get_mut(t)?.as_object_mut()?.get_mut(f)
    }
    match e {
        HeaderEdit::Shape(t, d, v) => {
            if let Some(s) = field(m, &pick(*t), "shape").and_then(Value::as_array_mut) {
                if s.is_empty() {
                    s.push(json!(v));
                } else {
                    let i = d % s.len();
                    s[i] = json!(v);
                }
            }
        }
        HeaderEdit::ShapeOdd(t, v) => {
            if let Some(s) = field(m, &pick(*t), "shape").and_then(Value::as_array_mut) {
                s.push(v.clone());
            }
        }
        HeaderEdit::Offset(t, i, v) => {
            if let Some(x) = field(m, &pick(*t), "data_offsets").and_then(|o| o.get_mut(*i)) {
                *x = json!(v);
            }
        }
        HeaderEdit::OffsetOdd(t, i, v) => {
            if let Some(x) = field(m, &pick(*t), "data_offsets").and_then(|o| o.get_mut(*i)) {
                *x = v.clone();
            }
        }
        HeaderEdit::Dtype(t, d) => {
            if let Some(x) = field(m, &pick(*t), "dtype") {
                *x = json!(d);
            }
        }
        HeaderEdit::DropField(t, f) => {
            let name = ["dtype", "shape", "data_offsets"][*f];
            if let Some(o) = m.get_mut(&pick(*t)).and_then(Value::as_object_mut) {
                o.remove(name);
            }
        }
        HeaderEdit::Duplicate(t) => {
            // The same extent under a second name: overlapping tensors.
            let v = m[&pick(*t)].clone();
            m.insert(format!("{}_again", pick(*t)), v);
        }
        HeaderEdit::NotAnObject(t) => {
            m.insert(pick(*t), json!([1, 2, 3]));
        }
    }
}

/// (header bytes, file length) as a hostile or damaged file presents them.
fn st_input() -> impl Strategy<Value = (Vec<u8>, u64)> {
    let structured = (
        vec(st_tensor(), 0..5),
        vec(header_edit(), 0..3),
        vec(byte_edit(), 0..2),
        prop_oneof![Just(0i64), -8i64..8, Just(i64::MIN)],
    )
        .prop_map(|(tensors, hedits, bedits, slack)| {
            let (mut h, data_len) = st_header(&tensors);
            for e in &hedits {
                apply_header_edit(&mut h, e);
            }
            let bytes = edit(serde_json::to_vec(&h).unwrap(), &bedits);
            let file_len = (8 + bytes.len() as u64 + data_len).saturating_add_signed(slack);
            (bytes, file_len)
        });
    prop_oneof![
        4 => structured,
        1 => (vec(any::<u8>(), 0..200), edge_u64()),
    ]
}

/// Whether `ACCEL_FUZZ_SKIP` (a comma-separated list) names `check`, so a
/// long run can go on past a known bug (here the one of
/// `overlapping_tensors_around_empty_ones_are_refused`).
fn skipped(check: &str) -> bool {
    std::env::var("ACCEL_FUZZ_SKIP").is_ok_and(|v| v.split(',').any(|c| c.trim() == check))
}

/// The generators must reach the accepting path too, or the "what parses"
/// half of a property checks nothing: at least 5 % of the cases.
fn reaches_success(what: &str, ok: &AtomicU64, cases: u64) {
    let ok = ok.load(Ordering::Relaxed);
    assert!(ok * 20 >= cases, "only {ok} of {cases} {what} parsed");
}

fn check_entries(
    entries: &[safetensors::TensorEntry],
    header_len: usize,
    file_len: u64,
) -> Result<(), TestCaseError> {
    let data_start = 8 + header_len as u64;
    let mut prev_end = data_start;
    for e in entries {
        let numel = e
            .meta
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64));
        let want = numel.and_then(|n| n.checked_mul(e.meta.dtype.size() as u64));
        prop_assert_eq!(Some(e.len), want, "tensor `{}` length", e.name);
        prop_assert!(
            e.start >= data_start,
            "tensor `{}` starts in the header",
            e.name
        );
        let end = e.start.checked_add(e.len);
        prop_assert!(
            end.is_some_and(|end| end <= file_len),
            "tensor `{}` ends past the file",
            e.name
        );
        if e.len > 0 {
            prop_assert!(
                e.start >= prev_end || skipped("safetensors-overlap"),
                "tensor `{}` overlaps the previous one",
                e.name
            );
            prev_end = prev_end.max(e.start + e.len);
        }
    }
    Ok(())
}

#[test]
fn safetensors_headers_never_panic_and_what_parses_fits_the_file() {
    let parsed = AtomicU64::new(0);
    let ran = budget::fuzz(
        "offload/safetensors-header",
        3000,
        st_input(),
        |(h, file_len)| {
            if let Ok(entries) =
                safetensors::parse_header(Path::new("fuzz.safetensors"), &h, file_len)
            {
                parsed.fetch_add(1, Ordering::Relaxed);
                check_entries(&entries, h.len(), file_len)?;
            }
            Ok(())
        },
    );
    reaches_success("safetensors headers", &parsed, ran.cases);
}

/// Found by the 10-minute run (batch 67 of `offload/safetensors-header`):
/// two tensors on the same bytes pass the overlap check when zero-length
/// tensors sort between them, because `parse_header` only compares
/// neighbours (offload/src/safetensors.rs, the `windows(2)` check).
#[test]
fn overlapping_tensors_around_empty_ones_are_refused() {
    let h = br#"{"__metadata__":{"format":"pt"},"a.00":{"data_offsets":[0,0],"dtype":"F32","shape":[0,0]},"aaa.00.00":{"data_offsets":[0,0],"dtype":"I8","shape":[0]},"[b.00":{"data_offsets":[0,2],"dtype":"BF16","shape":[1]},"ab.00_again":{"data_offsets":[0,2],"dtype":"BF16","shape":[1]}}"#;
    let file_len = 8 + h.len() as u64 + 2;
    let got = safetensors::parse_header(Path::new("overlap.safetensors"), h, file_len);
    let e = got.expect_err("two tensors on bytes 0..2 were accepted");
    assert!(e.to_string().contains("overlap"), "{e}");
}

#[test]
fn safetensors_files_never_panic_and_every_tensor_reads_in_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    // The file: an 8-byte header length (true, or a lie), the header, data.
    let input = (
        st_input(),
        proptest::option::of(edge_u64()),
        vec(any::<u8>(), 0..64),
    );
    budget::fuzz(
        "offload/safetensors-file",
        300,
        input,
        |((h, file_len), lie, tail)| {
            let mut f = lie.unwrap_or(h.len() as u64).to_le_bytes().to_vec();
            f.extend_from_slice(&h);
            // Data up to what the (possibly lying) length says, capped.
            let data = (file_len.saturating_sub(f.len() as u64)).min(4096) as usize;
            f.extend((0..data).map(|i| i as u8));
            f.extend_from_slice(&tail);
            std::fs::write(&path, &f).unwrap();
            let file_len = f.len() as u64;
            if let Ok(entries) = safetensors::read_header(&path) {
                check_entries(&entries, h.len(), file_len)?;
            }
            if let Ok(st) = SafetensorsFile::open(&path) {
                for e in st.entries() {
                    prop_assert_eq!(st.data(e).len() as u64, e.len);
                    let (_, d) = st.tensor(&e.name).unwrap();
                    prop_assert_eq!(d.len() as u64, e.len);
                }
            }
            Ok(())
        },
    );
}

// ------------------------------------------------------------ layout JSON

fn dtype_name() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => proptest::sample::select(DType::ALL.to_vec()).prop_map(|d| d.name().to_string()),
        1 => Just("torch.float32".to_string()),
        1 => "[a-z0-9]{0,6}",
    ]
}

fn shape() -> impl Strategy<Value = Value> {
    prop_oneof![
        8 => vec(0u64..6, 0..3).prop_map(|s| json!(s)),
        2 => vec(edge_u64(), 1..4).prop_map(|s| json!(s)),
        1 => odd_number().prop_map(|n| json!([n])),
    ]
}

fn tensor_json() -> impl Strategy<Value = Value> {
    ("[a-z]{1,2}|[0-9]", dtype_name(), shape())
        .prop_map(|(name, dtype, shape)| json!({"name": name, "dtype": dtype, "shape": shape}))
}

fn module_json() -> impl Strategy<Value = Value> {
    let leaf = (
        "[a-z0-9]{0,2}",
        vec(tensor_json(), 0..3),
        vec(tensor_json(), 0..2),
    )
        .prop_map(
            |(name, params, buffers)| json!({"name": name, "params": params, "buffers": buffers}),
        );
    leaf.prop_recursive(4, 24, 4, |inner| {
        (
            "[a-z0-9]{0,2}",
            proptest::option::of("[A-Z][a-z]{0,5}"),
            vec(tensor_json(), 0..2),
            vec(inner, 0..4),
        )
            .prop_map(|(name, class, params, children)| {
                json!({"name": name, "class": class, "params": params, "children": children})
            })
    })
}

/// Bytes that print as (lossy) text in a failure report.
#[derive(Clone)]
struct Text(Vec<u8>);

impl std::fmt::Debug for Text {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", String::from_utf8_lossy(&self.0))
    }
}

fn layout_text() -> impl Strategy<Value = Text> {
    let tied = vec(vec("[a-z]{1,2}(\\.[a-z0-9]{1,2}){0,2}", 0..3), 0..3);
    let format = prop_oneof![
        8 => Just("accel-layout/1".to_string()),
        1 => "[a-z/0-9-]{0,16}",
    ];
    let doc = (format, module_json(), tied)
        .prop_map(|(format, root, tied)| json!({"format": format, "root": root, "tied": tied}));
    prop_oneof![
        6 => (doc, vec(byte_edit(), 0..3))
            .prop_map(|(d, e)| Text(edit(serde_json::to_vec(&d).unwrap(), &e))),
        1 => vec(any::<u8>(), 0..200).prop_map(Text),
    ]
}

fn check_layout(l: &Layout) -> Result<(), TestCaseError> {
    let tensors = l.nodes().filter(|n| n.is_tensor()).count();
    prop_assert_eq!(l.tensor_count(), tensors);
    for (i, n) in l.nodes().enumerate() {
        prop_assert_eq!(
            l.id(n.name()),
            Some(i as u32),
            "node `{}` by name",
            n.name()
        );
        prop_assert!(n.end() as usize <= l.nodes().len());
    }
    // What loads saves and loads again to the same tree.
    let again = Layout::from_json(&l.to_json())
        .map_err(|e| TestCaseError::fail(format!("a saved layout does not load: {e}")))?;
    prop_assert_eq!(again.nodes().len(), l.nodes().len());
    Ok(())
}

#[test]
fn layout_json_never_panics_and_what_loads_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("layout.json");
    let loaded = AtomicU64::new(0);
    let ran = budget::fuzz("offload/layout-json", 1500, layout_text(), |Text(text)| {
        let parsed = serde_json::from_slice::<LayoutJson>(&text)
            .ok()
            .map(|doc| Layout::from_json(&doc));
        if let Some(Ok(l)) = &parsed {
            loaded.fetch_add(1, Ordering::Relaxed);
            check_layout(l)?;
        }
        // The file entry agrees with the in-memory one.
        std::fs::write(&path, &text).unwrap();
        let from_file = Layout::from_json_file(&path);
        prop_assert_eq!(
            from_file.is_ok(),
            matches!(parsed, Some(Ok(_))),
            "from_json_file and from_json disagree"
        );
        Ok(())
    });
    reaches_success("layouts", &loaded, ran.cases);
}

/// Fails on main (2026-12-01): a layout tensor whose byte size overflows
/// `u64`/`usize` (e.g. `"shape":[9223372036854775808]`, dtype f16) loads,
/// then `plan::total_size` panics in `TensorMeta::byte_len` (debug; it
/// wraps in release): issue 22 item 8, owned by the offload work.
#[test]
fn planning_any_layout_that_loads_never_panics() {
    let budgets = prop_oneof![
        Just(None),
        Just(Some("cpu=1GiB,disk".to_string())),
        Just(Some("cuda:0=1KiB,cpu=1MiB,disk".to_string())),
        Just(Some("cuda:0=16EiB".to_string())),
        Just(Some(format!("cuda:0={},cpu={}", u64::MAX, u64::MAX))),
    ];
    budget::fuzz(
        "offload/plan-layout",
        800,
        (layout_text(), budgets),
        |(Text(text), budget)| {
            let Ok(doc) = serde_json::from_slice::<LayoutJson>(&text) else {
                return Ok(());
            };
            let Ok(layout) = Layout::from_json(&doc) else {
                return Ok(());
            };
            let opts = PlanOptions {
                max_memory: budget.and_then(|b| MaxMemory::parse(&b).ok()),
                ..PlanOptions::default()
            };
            let total = plan::total_size(&layout, &opts);
            // Every tensor's bytes are in the total: no wrapped product.
            for n in layout
                .nodes()
                .filter(|n| n.is_tensor() && n.alias_of().is_none())
            {
                let meta = n.meta().unwrap();
                let bytes = meta
                    .shape
                    .iter()
                    .try_fold(meta.dtype.size() as u64, |a, &d| a.checked_mul(d as u64));
                if let Some(b) = bytes {
                    prop_assert!(
                        total >= b,
                        "total {total} < tensor `{}` of {b} bytes",
                        n.name()
                    );
                }
            }
            let _ = plan::plan(&layout, &opts);
            let _ = plan::largest_layer(&layout, &opts);
            Ok(())
        },
    );
}

// ------------------------------------------------------------ sizes

const UNITS: &[(&str, u64)] = &[
    ("", 1),
    ("b", 1),
    ("B", 1),
    ("bytes", 1),
    ("KB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("TB", 1_000_000_000_000),
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("TiB", 1 << 40),
    ("gib", 1 << 30),
];

#[test]
fn size_strings_never_panic_and_integers_scale_exactly() {
    fn well_formed() -> impl Strategy<Value = (String, Option<(u64, u64)>)> {
        let unit = proptest::sample::select(UNITS.to_vec());
        let spaced = || proptest::sample::select(vec!["", " ", "  "]);
        (edge_u64(), unit, spaced(), spaced())
            .prop_map(|(n, (u, m), a, b)| (format!("{a}{n}{b}{u}"), Some((n, m))))
    }
    let mutated = (well_formed(), vec(byte_edit(), 1..3)).prop_map(|((s, _), e)| {
        let s: String = String::from_utf8_lossy(&edit(s.into_bytes(), &e)).into_owned();
        (s, None::<(u64, u64)>)
    });
    let well_formed = well_formed();
    let fractional = (
        "[0-9]{0,20}\\.[0-9]{0,20}",
        proptest::sample::select(UNITS.to_vec()),
    )
        .prop_map(|(n, (u, _))| (format!("{n}{u}"), None::<(u64, u64)>));
    let input = prop_oneof![
        3 => well_formed,
        3 => mutated,
        2 => fractional,
        1 => any::<String>().prop_map(|s| (s, None::<(u64, u64)>)),
    ];
    budget::fuzz(
        "offload/size",
        5000,
        input,
        |(s, expect): (String, Option<(u64, u64)>)| {
            let got = parse_size(&s);
            if let Some((n, m)) = expect {
                // A bare number with no unit parses as bytes; with a unit, as
                // n times it, or not at all when that overflows.
                prop_assert_eq!(got, n.checked_mul(m), "parse_size({:?})", s);
            }
            Ok(())
        },
    );
}

#[test]
fn max_memory_specs_never_panic_and_what_parses_is_consistent() {
    let device = prop_oneof![
        Just("cpu".to_string()),
        Just("disk".to_string()),
        "cuda:[0-3]",
        "[0-9]{1,2}",
        "[a-z_:0-9]{0,6}",
    ];
    let size = prop_oneof![
        Just(String::new()),
        edge_u64().prop_map(|n| format!("={n}")),
        (0u32..100_000, proptest::sample::select(UNITS.to_vec()))
            .prop_map(|(n, (u, _))| format!("={n}{u}")),
        "=[ -~]{0,8}",
    ];
    let item = (device, size).prop_map(|(d, s)| format!("{d}{s}"));
    let spec = prop_oneof![
        4 => vec(item, 0..5).prop_map(|v| v.join(",")),
        1 => any::<String>(),
    ];
    let parsed = AtomicU64::new(0);
    let ran = budget::fuzz("offload/max-memory", 3000, spec, |spec| {
        if let Ok(m) = MaxMemory::parse(&spec) {
            parsed.fetch_add(1, Ordering::Relaxed);
            prop_assert!(!m.devices.is_empty());
            for (i, (t, b)) in m.devices.iter().enumerate() {
                prop_assert!(b.is_some() || *t == Target::Disk, "{} has no budget", t);
                // Each device once; accelerators first, then cpu, then disk.
                prop_assert!(!m.devices[..i].iter().any(|(u, _)| u == t), "{} twice", t);
                if let Some((next, _)) = m.devices.get(i + 1) {
                    let rank = |t: &Target| match t {
                        Target::Accelerator(_) => 0,
                        Target::Cpu => 1,
                        Target::Disk => 2,
                    };
                    prop_assert!(rank(t) <= rank(next));
                }
            }
        }
        Ok(())
    });
    reaches_success("--max-memory specs", &parsed, ran.cases);
}
