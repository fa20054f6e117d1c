//! `cargo test` runs the conformance matrix for every backend available on
//! this machine: single, cpu-gloo and mpi (when compiled in; mpi under
//! `mpirun -n N`) at world sizes 1-4, and the same engines through the
//! plugin boundary. Each world runs under a hard
//! timeout. The printed matrix is the same `accel test` prints.

use std::path::{Path, PathBuf};

use accel_conformance::harness::{cpu_columns, Matrix, RunSpec};

/// Skips that say nothing about a backend's capabilities: (scenario, or
/// `*` for any; the start of the reason). Any other skip, such as a
/// scenario whose operation or element type a backend stopped declaring,
/// fails the matrix: a lost capability must not turn into quiet skips.
const STRUCTURAL_SKIPS: [(&str, &str); 2] = [
    // Failure and mismatch scenarios at world size 1.
    ("*", "needs 2+ ranks"),
    // The refusal of an undeclared element type, on engines that declare
    // every type for reductions.
    ("undeclared_is_unsupported", "every dtype is declared"),
];

/// The matrix's skips that [`STRUCTURAL_SKIPS`] does not explain.
fn unexplained_skips(matrix: &Matrix) -> Vec<String> {
    let mut out = Vec::new();
    for w in &matrix.worlds {
        for r in &w.results {
            if let accel_conformance::Outcome::Skip(reason) = &r.outcome {
                let explained = STRUCTURAL_SKIPS.iter().any(|(name, why)| {
                    (*name == "*" || *name == r.name) && reason.starts_with(why)
                });
                if !explained {
                    out.push(format!("{} {}: skipped: {reason}", w.label, r.name));
                }
            }
        }
    }
    out
}

fn worker() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_accel-conformance-worker"))
}

#[test]
fn conformance_matrix() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root");
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("target dir");
    let mut specs = cpu_columns(&worker(), workspace, target).unwrap_or_else(|e| panic!("{e}"));
    // Device backends compiled in: probed here as the worker would; a
    // column runs only where the hardware is, otherwise it is listed as not
    // run with the probe's reason (never counted as a pass).
    let registry = accel::Registry::builtin();
    for name in ["cuda-nccl", "npu-hccl"] {
        let Some(entry) = registry.get(name) else {
            continue;
        };
        for n in 1..=4 {
            let probe = entry.backend.probe(&accel_api::ProbeContext {
                world_size: n,
                local_world_size: n,
                mpi_launched: false,
                ranks_in_process: 1,
            });
            match probe.reason() {
                Some(reason) => eprintln!("{name}@{n}: not run: {reason}"),
                None => specs.push(RunSpec::new(name, n, worker())),
            }
        }
    }
    let matrix = Matrix::run_jobs(&specs, 3);
    let text = matrix.render();
    println!("{text}");
    let s = matrix.summary();
    assert_eq!(s.failed, 0, "conformance failures:\n{text}");
    assert!(s.passed > 0, "nothing passed:\n{text}");
    let lost = unexplained_skips(&matrix);
    assert!(
        lost.is_empty(),
        "skips that no world size or engine explains (did a backend stop declaring an \
         operation or element type? if that is meant, add the skip to STRUCTURAL_SKIPS \
         with its reason):\n{}",
        lost.join("\n")
    );
    // Columns of one engine must agree: the plugin column has exactly the
    // outcomes of the statically linked one.
    for n in 1..=4 {
        let a = matrix
            .worlds
            .iter()
            .find(|w| w.label == format!("cpu-gloo@{n}"));
        let b = matrix
            .worlds
            .iter()
            .find(|w| w.label == format!("cpu-gloo-plugin@{n}"));
        if let (Some(a), Some(b)) = (a, b) {
            let cells = |w: &accel_conformance::harness::WorldReport| {
                w.results
                    .iter()
                    .map(|r| (r.name.clone(), r.outcome.cell()))
                    .collect::<Vec<_>>()
            };
            assert_eq!(
                cells(a),
                cells(b),
                "static and plugin cpu-gloo disagree at world size {n}"
            );
        }
    }
}

#[test]
fn a_skip_from_a_lost_capability_is_unexplained_and_world_size_one_is_not() {
    use accel_conformance::harness::WorldReport;
    use accel_conformance::{Outcome, ScenarioResult};
    let cell = |name: &str, reason: &str| ScenarioResult {
        name: name.into(),
        outcome: Outcome::Skip(reason.into()),
        millis: 0,
    };
    let world = |label: &str, results| WorldReport {
        label: label.into(),
        results,
        error: None,
        seed: None,
        millis: 0,
    };
    let m = Matrix {
        worlds: vec![
            world("mpi@1", vec![cell("lost_rank_is_named", "needs 2+ ranks")]),
            world(
                "mpi@2",
                vec![
                    cell(
                        "undeclared_is_unsupported",
                        "every dtype is declared for reductions",
                    ),
                    cell("all_to_all_roundtrip", "mpi does not declare all_to_all"),
                ],
            ),
        ],
    };
    assert_eq!(
        unexplained_skips(&m),
        ["mpi@2 all_to_all_roundtrip: skipped: mpi does not declare all_to_all"]
    );
}
