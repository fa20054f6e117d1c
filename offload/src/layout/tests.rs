use super::json::RawDType;
use super::*;

fn m(shape: &[usize]) -> TensorMeta {
    TensorMeta {
        dtype: DType::F32,
        shape: shape.to_vec(),
    }
}

#[test]
fn tree_from_names_orders_numbers_numerically() {
    let names = [
        "model.layers.10.w",
        "model.layers.2.w",
        "lm_head.weight",
        "model.embed.weight",
        "model.layers.2.b",
    ];
    let l = Layout::from_tensors(names.iter().map(|n| (n.to_string(), m(&[2]))), &[]).unwrap();
    let order: Vec<&str> = l.nodes().map(|n| n.name()).collect();
    assert_eq!(
        order,
        [
            "",
            "model",
            "model.embed",
            "model.embed.weight",
            "model.layers",
            "model.layers.2",
            "model.layers.2.b",
            "model.layers.2.w",
            "model.layers.10",
            "model.layers.10.w",
            "lm_head",
            "lm_head.weight",
        ]
    );
    assert!(l.order_inferred());
    let layers = l.id("model.layers").unwrap();
    assert_eq!(l.node(layers).end(), l.id("lm_head").unwrap());
    assert_eq!(l.tensors_under("model.layers").unwrap().len(), 3);
}

#[test]
fn tied_alias_added_when_checkpoint_stores_it_once() {
    let names = ["embed.weight", "body.w"];
    let tied = vec![vec!["embed.weight".to_string(), "head.weight".to_string()]];
    let l = Layout::from_tensors(names.iter().map(|n| (n.to_string(), m(&[4, 2]))), &tied).unwrap();
    let head = l.id("head.weight").unwrap();
    let embed = l.id("embed.weight").unwrap();
    assert_eq!(l.node(head).alias_of(), Some(embed));
    // The stored member owns the storage even when it sorts later.
    let names = ["z.weight", "body.w"];
    let tied = vec![vec!["z.weight".to_string(), "a.weight".to_string()]];
    let l2 =
        Layout::from_tensors(names.iter().map(|n| (n.to_string(), m(&[4, 2]))), &tied).unwrap();
    assert_eq!(
        l2.node(l2.id("a.weight").unwrap()).alias_of(),
        l2.id("z.weight")
    );
    assert_eq!(l.tied(), &[vec![embed, head]]);
}

#[test]
fn json_round_trip_and_errors() {
    let text = r#"{"format":"accel-layout/1","root":{"name":"","class":"Net","children":[
        {"name":"a","class":"Linear","params":[{"name":"weight","dtype":"float16","shape":[3,3]}],
         "buffers":[{"name":"scale","dtype":"f32","shape":[]}]},
        {"name":"b","class":"Linear","params":[{"name":"weight","dtype":"f16","shape":[3,3]}]}]},
        "tied":[["a.weight","b.weight"]]}"#;
    let doc: LayoutJson = serde_json::from_str(text).unwrap();
    let l = Layout::from_json(&doc).unwrap();
    assert_eq!(l.node(l.id("a").unwrap()).class(), Some("Linear"));
    assert_eq!(l.node(l.id("a.scale").unwrap()).kind(), NodeKind::Buffer);
    assert_eq!(l.tied().len(), 1);
    let back = Layout::from_json(&l.to_json()).unwrap();
    assert_eq!(back.nodes().len(), l.nodes().len());
    let mut bad = doc.clone();
    bad.tied = vec![vec!["a.weight".into(), "nope".into()]];
    assert!(Layout::from_json(&bad)
        .unwrap_err()
        .to_string()
        .contains("nope"));
    assert!(Layout::from_tensors(
        [("a".to_string(), m(&[1])), ("a.b".to_string(), m(&[1]))],
        &[]
    )
    .is_err());
}

#[test]
fn inferred_order_puts_embeddings_first_and_heads_last() {
    // GPT-2's names: alphabetically `h` < `ln_f` < `wpe` < `wte`.
    let names = ["h.10.w", "h.2.w", "ln_f.weight", "wpe.weight", "wte.weight"];
    let l = Layout::from_tensors(names.iter().map(|n| (n.to_string(), m(&[2]))), &[]).unwrap();
    let mods: Vec<&str> = l.node(0).children().map(|c| l.node(c).name()).collect();
    assert_eq!(mods, ["wte", "wpe", "h", "ln_f"]);
    let h = l.node(l.id("h").unwrap());
    let layers: Vec<&str> = h.children().map(|c| l.node(c).name()).collect();
    assert_eq!(layers, ["h.2", "h.10"]);
    // A layout from the model keeps the model's order and says so.
    let back = Layout::from_json(&l.to_json()).unwrap();
    assert!(!back.order_inferred());
}

#[test]
fn sizes_that_overflow_64_bits_are_refused() {
    // 2^62 + 1 f32 elements: 2^64 + 4 bytes, which wraps to 4.
    let huge = TensorMeta {
        dtype: DType::F32,
        shape: vec![(1usize << 62) + 1],
    };
    assert_eq!(checked_bytes(&huge), None);
    let e = Layout::from_tensors([("w".to_string(), huge.clone())], &[]).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
    assert!(
        e.to_string().contains("`w`") && e.to_string().contains("2^64"),
        "{e}"
    );
    let text = format!(
        r#"{{"format":"accel-layout/1","root":{{"params":[{{"name":"w","dtype":"f32","shape":[{}]}}]}}}}"#,
        (1u64 << 62) + 1
    );
    let doc: LayoutJson = serde_json::from_str(&text).unwrap();
    assert!(Layout::from_json(&doc)
        .unwrap_err()
        .to_string()
        .contains("2^64"));
    // Each fits, the sum does not.
    let half = TensorMeta {
        dtype: DType::F32,
        shape: vec![1usize << 61],
    };
    let e = Layout::from_tensors(
        [("a".to_string(), half.clone()), ("b".to_string(), half)],
        &[],
    )
    .unwrap_err();
    assert!(e.to_string().contains("in all"), "{e}");
}

#[test]
fn non_persistent_buffers_round_trip() {
    let text = r#"{"format":"accel-layout/1","root":{"children":[
        {"name":"rope","buffers":[{"name":"inv_freq","dtype":"f32","shape":[64],"persistent":false},
                                  {"name":"kept","dtype":"f32","shape":[2]}]}]}}"#;
    let l = Layout::from_json(&serde_json::from_str(text).unwrap()).unwrap();
    assert!(!l.node(l.id("rope.inv_freq").unwrap()).persistent());
    assert!(l.node(l.id("rope.kept").unwrap()).persistent());
    let j = serde_json::to_string(&l.to_json()).unwrap();
    assert_eq!(j.matches("\"persistent\":false").count(), 1, "{j}");
}

fn same(a: &Layout, b: &Layout) {
    assert_eq!(a.nodes().len(), b.nodes().len());
    for (x, y) in a.nodes().zip(b.nodes()) {
        assert_eq!(
            (
                &x.name(),
                &x.class(),
                x.kind(),
                &x.meta(),
                x.parent(),
                x.children().collect::<Vec<_>>(),
                x.end(),
                x.alias_of(),
                x.persistent()
            ),
            (
                &y.name(),
                &y.class(),
                y.kind(),
                &y.meta(),
                y.parent(),
                y.children().collect::<Vec<_>>(),
                y.end(),
                y.alias_of(),
                y.persistent()
            )
        );
    }
    assert_eq!(a.tied(), b.tied());
}

#[test]
fn file_parse_matches_the_tree_path_in_any_key_order() {
    let l = crate::synth::llama_layout(crate::synth::LlamaShape::tiny(3, 2), DType::BF16);
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("l.json");
    std::fs::write(&f, serde_json::to_vec(&l.to_json()).unwrap()).unwrap();
    same(&Layout::from_json_file(&f).unwrap(), &l);
    assert!(l.id("model.layers.2.mlp.experts.1.w3.weight").is_some());
    // A file large enough to be mapped rather than read (tied weights too).
    let big = crate::synth::llama_layout(crate::synth::LlamaShape::tiny(16, 400), DType::BF16);
    let text = serde_json::to_vec(&big.to_json()).unwrap();
    assert!(text.len() > 1 << 20, "{}", text.len());
    std::fs::write(&f, text).unwrap();
    same(&Layout::from_json_file(&f).unwrap(), &big);
    // Keys in another order (name last, children before params,
    // escaped strings): the same layout through the fallback.
    let text = r#"{"tied":[["a.weight","b.weight"]],"root":{"children":[
        {"params":[{"shape":[3],"dtype":"torch.float32","name":"weight"}],"class":"Lin\u0065ar","name":"a"},
        {"children":[{"name":"act"}],"params":[{"name":"weight","dtype":"f32","shape":[3]}],"name":"b",
         "buffers":[{"name":"m","dtype":"u8","shape":[2],"persistent":false}]}],"name":""},
        "format":"accel-layout/1"}"#;
    std::fs::write(&f, text).unwrap();
    let a = Layout::from_json_file(&f).unwrap();
    let b = Layout::from_json(&serde_json::from_str(text).unwrap()).unwrap();
    same(&a, &b);
    assert_eq!(a.node(a.id("a").unwrap()).class(), Some("Linear"));
    assert_eq!(
        a.node(a.id("b.weight").unwrap()).alias_of(),
        a.id("a.weight")
    );
    assert!(!a.node(a.id("b.m").unwrap()).persistent());
}

#[test]
fn duplicate_and_dotted_names_are_refused_on_both_paths() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("l.json");
    for (text, want) in [
        (
            r#"{"format":"accel-layout/1","root":{"children":[{"name":"a","params":[{"name":"w","dtype":"f32","shape":[1]}]},{"name":"a"}]}}"#,
            "`a` is both a module and a tensor, or appears twice",
        ),
        (
            r#"{"format":"accel-layout/1","root":{"children":[{"name":"a.b","params":[{"name":"w","dtype":"f32","shape":[1]}]}]}}"#,
            "hold no `.`",
        ),
        (
            r#"{"format":"accel-layout/1","root":{"params":[{"name":"w","dtype":"f32","shape":[1]},{"name":"w","dtype":"f32","shape":[1]}]}}"#,
            "`w` is both",
        ),
    ] {
        std::fs::write(&f, text).unwrap();
        let e = Layout::from_json_file(&f).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
        let e = Layout::from_json(&serde_json::from_str(text).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{e}");
    }
}

#[test]
fn the_fast_reader_takes_what_this_crate_writes() {
    let l = crate::synth::llama_layout(crate::synth::LlamaShape::tiny(3, 2), DType::BF16);
    let doc = l.to_json();
    for text in [
        serde_json::to_string(&doc).unwrap(),
        serde_json::to_string_pretty(&doc).unwrap(),
    ] {
        let fast = parse::read_fast(&text).expect("the fast reader takes the writer's form");
        same(&fast, &l);
    }
}

/// Every layout the fast reader takes is the one the tree path builds from
/// the same text: checked on every one-byte deletion and substitution of a
/// small document with every feature of the format.
#[test]
fn the_fast_reader_agrees_with_the_tree_path_on_edited_text() {
    let text = r#"{"format":"accel-layout/1","root":{"name":"","class":"Top",
        "params":[{"name":"p","dtype":"f16","shape":[]}],
        "buffers":[{"name":"r","dtype":"torch.float32","shape":[4],"persistent":false}],
        "children":[{"name":"a","class":"Linear","params":[{"name":"weight","dtype":"bf16","shape":[3,20]}]},
          {"name":"b","class":null,"children":[{"name":"c","params":[{"name":"weight","dtype":"f32","shape":[3,20]}],
            "buffers":[{"name":"m","dtype":"u8","shape":[10],"persistent":true}]}]}]},
        "tied":[["a.weight","b.c.weight"]]}"#;
    let tree = |t: &str| {
        serde_json::from_str::<RawDoc<'_>>(t)
            .ok()
            .and_then(|d| Layout::from_raw(d).ok())
    };
    let whole = parse::read_fast(text).expect("the fast reader takes the document");
    same(&whole, &tree(text).unwrap());
    let (mut taken, mut tried) = (0, 0);
    let bytes = text.as_bytes();
    for i in 0..bytes.len() {
        let mut edits = vec![[&bytes[..i], &bytes[i + 1..]].concat()];
        for &c in b"0,:\"{}[]\\ 9x-.nt" {
            let mut e = bytes.to_vec();
            e[i] = c;
            edits.push(e);
        }
        for e in edits {
            let Ok(t) = std::str::from_utf8(&e) else {
                continue;
            };
            tried += 1;
            if let Some(fast) = parse::read_fast(t) {
                taken += 1;
                let Some(slow) = tree(t) else {
                    panic!("the fast reader took text the tree path refuses: {t}");
                };
                same(&fast, &slow);
            }
        }
    }
    assert!(taken > 100 && taken < tried, "{taken} of {tried}");
}

#[test]
fn duplicates_among_many_siblings_are_found() {
    let w = |n: &str| (n.to_string(), m(&[1]));
    // A module list (`0`, `1`, ...) with one index twice, and named
    // siblings with one name twice: both refused, with the sorted-first
    // duplicate named.
    let mut list: Vec<_> = (0..12).map(|k| w(&format!("l.{k}.w"))).collect();
    list.push(w("l.3.w"));
    let e = Layout::from_tensors(list, &[]).unwrap_err().to_string();
    assert!(e.contains("appears twice"), "{e}");
    let text = |names: &[&str]| {
        let kids: Vec<String> = names
            .iter()
            .map(|n| {
                format!(r#"{{"name":"{n}","params":[{{"name":"w","dtype":"f32","shape":[1]}}]}}"#)
            })
            .collect();
        format!(
            r#"{{"format":"accel-layout/1","root":{{"children":[{}]}}}}"#,
            kids.join(",")
        )
    };
    let many = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k"];
    let ok = text(&many);
    assert!(parse::read_fast(&ok).is_some());
    for dup in [
        &["a", "b", "c", "d", "e", "f", "g", "h", "i", "c", "b"][..],
        &["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "3"],
    ] {
        let t = text(dup);
        assert!(parse::read_fast(&t).is_none());
        let e = Layout::from_json(&serde_json::from_str(&t).unwrap())
            .unwrap_err()
            .to_string();
        let want = format!("`{}` is both", if dup[0] == "a" { "b" } else { "3" });
        assert!(e.contains(&want), "{e}");
    }
}

#[test]
fn the_fast_reader_reads_every_dtype_name() {
    let tree = |v: &str| {
        serde_json::from_str::<RawDType>(&format!("{v:?}"))
            .ok()
            .map(|d| d.0)
    };
    for &d in DType::ALL.iter() {
        assert_eq!(parse::dtype_named(d.name()), Some(d));
        assert_eq!(tree(d.name()), Some(d));
    }
    for v in [
        "torch.bfloat16",
        "float16",
        "torch.int64",
        "bf17",
        "",
        "torch.",
    ] {
        assert_eq!(parse::dtype_named(v), tree(v), "{v}");
    }
}

/// Found by the long fuzz run of `fuzz_inputs` (batch 3): serde skips the
/// value of an unknown key without checking its UTF-8, so the file entry
/// must not refuse such a text up front where `from_json` takes it.
#[test]
fn the_file_entry_takes_invalid_utf8_where_serde_skips_it() {
    let mut text = br#"{"format":"accel-layout/1","root":{"junk":"xy","children":[{"name":"a","params":[{"name":"w","dtype":"f32","shape":[2]}]}]}}"#.to_vec();
    let at = text.windows(2).position(|w| w == b"xy").unwrap();
    text[at] = 0xff;
    assert!(std::str::from_utf8(&text).is_err());
    let from_json = Layout::from_json(&serde_json::from_slice(&text).unwrap()).unwrap();
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("l.json");
    std::fs::write(&f, &text).unwrap();
    same(&Layout::from_json_file(&f).unwrap(), &from_json);
    // Invalid UTF-8 in a name is refused by both.
    let mut bad = br#"{"format":"accel-layout/1","root":{"children":[{"name":"x"}]}}"#.to_vec();
    let at = bad.iter().position(|&c| c == b'x').unwrap();
    bad[at] = 0xff;
    std::fs::write(&f, &bad).unwrap();
    let e = Layout::from_json_file(&f).unwrap_err();
    assert!(e.to_string().contains("not a layout file"), "{e}");
    assert!(serde_json::from_slice::<LayoutJson>(&bad).is_err());
}
