//! all-MiniLM-L6-v2 through accel-tch's dispatch: the embeddings with most
//! layers on disk are the embeddings with everything resident, and the
//! cosine similarities are sentence-transformers' (values and how they were
//! obtained in docs/inference.md).
//!
//! Needs the model (`make minilm-setup`, part of `make tch-test`). Without
//! it the test says so and passes, except under CI (`CI` set), where it
//! fails.

use accel_example_tch_minilm::{
    default_model_dir, embed, similarities, Bert, Config, Tokenizer, SENTENCES,
};
use accel_offload::plan::{MaxMemory, Target};
use tch::nn::VarStore;
use tch::Device;

/// Cosine similarities of [`SENTENCES`]: (0, 1) and (2, 3) are
/// sentence-transformers' values (issue 20); the others come from
/// `tools/minilm_reference.py` (NumPy, Python `tokenizers`), which gives
/// those two as well (docs/inference.md).
const REFERENCE: [(usize, usize, f32); 8] = [
    (0, 1, 0.7553),
    (2, 3, 0.8939),
    (0, 2, -0.0402),
    (0, 4, 0.2765),
    (1, 4, 0.2747),
    (1, 5, 0.1036),
    (3, 4, -0.0134),
    (4, 5, 0.0244),
];

#[test]
fn offloaded_embeddings_equal_resident_ones_and_match_sentence_transformers() {
    let dir = default_model_dir();
    if !dir.join("model.safetensors").exists() {
        let msg = format!(
            "no MiniLM model at {}: run `make minilm-setup` (scripts/fetch_minilm.sh)",
            dir.display()
        );
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("skipped: {msg}");
        return;
    }
    let cfg = Config::load(&dir).unwrap();
    let tok = Tokenizer::load(&dir).unwrap();
    let sentences = SENTENCES;

    let run = |max_memory: Option<&str>| {
        let vs = VarStore::new(Device::Cpu);
        let model = Bert::new(&vs, &cfg);
        let d = model
            .dispatch(
                &vs,
                &dir,
                max_memory.map(|m| MaxMemory::parse(m).unwrap()),
                1,
            )
            .unwrap();
        let emb = embed(&tok, &model, &d, &sentences).unwrap();
        let on_disk = d
            .plan()
            .devices
            .iter()
            .find(|p| p.device == Target::Disk)
            .map(|p| p.used);
        (emb, on_disk.unwrap_or(0), d.report().resident_bytes)
    };
    let (resident, disk0, res0) = run(None);
    let (offloaded, disk1, res1) = run(Some("cpu=20MiB,disk"));
    // A split: the embeddings and layer 0 on cpu, layers 1-5 on disk.
    let (split, disk2, res2) = run(Some("cpu=60MiB,disk"));

    // The budgets did what they say: nothing on disk without offload, most
    // of the 87 MiB model there with 20 MiB of cpu.
    assert_eq!(disk0, 0);
    assert!(res0 > 80 << 20, "resident bytes without offload: {res0}");
    assert!(disk1 > 60 << 20, "bytes on disk with cpu=20MiB: {disk1}");
    assert!(res1 <= 20 << 20, "resident bytes with cpu=20MiB: {res1}");
    assert!(
        res2 > 45 << 20 && res2 <= 60 << 20,
        "resident bytes with cpu=60MiB: {res2}"
    );
    assert!(disk2 > 25 << 20, "bytes on disk with cpu=60MiB: {disk2}");

    // Same weights, same kernels, same order: the same bits.
    assert_eq!(resident.size(), [6, 384]);
    let diff = (&resident - &offloaded).abs().max().double_value(&[]);
    assert_eq!(
        diff, 0.0,
        "offloaded embeddings differ from resident ones by {diff}"
    );
    let diff = (&resident - &split).abs().max().double_value(&[]);
    assert_eq!(
        diff, 0.0,
        "split embeddings differ from resident ones by {diff}"
    );

    let sims = similarities(&offloaded);
    for &(i, j, want) in &REFERENCE {
        let got = sims[i][j];
        assert!(
            (got - want).abs() < 1e-3,
            "cos({:?}, {:?}) = {got}, the reference gives {want}",
            sentences[i],
            sentences[j]
        );
        assert!(
            (sims[j][i] - got).abs() < 1e-6,
            "similarity matrix not symmetric"
        );
    }
    // Unit vectors: each sentence's similarity to itself is 1.
    for (i, row) in sims.iter().enumerate() {
        assert!((row[i] - 1.0).abs() < 1e-5, "cos(s{i}, s{i}) = {}", row[i]);
    }
}

/// `--check-rss` bounds the peak by the batch it ran: 19 ordinary sentences
/// (issue 30 found the old fixed 16 MiB slack failing them: 96 MiB over the
/// baseline against a bound of 88 MiB) pass, with the activations named in
/// the bound.
#[test]
fn check_rss_allows_for_the_batch_it_runs() {
    let dir = default_model_dir();
    if !dir.join("model.safetensors").exists() {
        let msg = format!(
            "no MiniLM model at {}: run `make minilm-setup`",
            dir.display()
        );
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("skipped: {msg}");
        return;
    }
    let sentences: Vec<String> = (1..=19)
        .map(|i| format!("Sentence {i} is an ordinary one about the weather, a train and a dog."))
        .collect();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_minilm-embed"))
        .args(["--max-memory", "cpu=20MiB,disk", "--check-rss"])
        .args(&sentences)
        // As a user runs it: glibc's default (dynamic) mmap threshold.
        .env_remove("MALLOC_MMAP_THRESHOLD_")
        .args(["--passes", "3"])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("activations (19 x "), "{text}");
}
