//! `cargo test` runs the conformance matrix for every backend available on
//! this machine: single, cpu-gloo and mpi (when compiled in; mpi under
//! `mpirun -n N`) at world sizes 1-4, and the same engines through the
//! plugin boundary. Each world runs under a hard
//! timeout. The printed matrix is the same `accel test` prints.

use std::path::{Path, PathBuf};

use accel_conformance::harness::{cpu_columns, Matrix, RunSpec};

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
