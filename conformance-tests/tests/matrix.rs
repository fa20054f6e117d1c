//! `cargo test` runs the conformance matrix for every backend available on
//! this machine: single, cpu-gloo and mpi (when compiled in; mpi under
//! `mpirun -n N`) at world sizes 1-4, and the same engines through the
//! plugin boundary. Each world runs under a hard
//! timeout. The printed matrix is the same `accel test` prints.

use std::path::{Path, PathBuf};

#[path = "../../test-support/skips.rs"]
mod skips;

use accel_conformance::harness::{build_cdylibs, run_world, Launcher, Matrix, RunSpec};

fn worker() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_accel-conformance-worker"))
}

fn plugin(packages: &[&str], stem: &str) -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root");
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("target dir");
    let found = build_cdylibs(workspace, target, packages).unwrap_or_else(|e| panic!("{e}"));
    found
        .into_iter()
        .find(|p| {
            p.file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.contains(stem))
        })
        .unwrap_or_else(|| panic!("no {stem} plugin was built"))
}

#[test]
fn conformance_matrix() {
    let mut specs = vec![RunSpec::new("single", 1, worker())];
    let vendor = plugin(&["accel-vendor-plugin"], "accel_vendor_plugin");
    specs.push(RunSpec::new("vendor-single", 1, worker()).with_plugin(Some(vendor)));
    if cfg!(feature = "cpu-gloo") {
        let gloo_plugin = plugin(&["accel-cpu-gloo-plugin"], "accel_cpu_gloo_plugin");
        for n in 1..=4 {
            specs.push(RunSpec::new("cpu-gloo", n, worker()));
        }
        for n in 1..=4 {
            specs.push(
                RunSpec::new("cpu-gloo-plugin", n, worker()).with_plugin(Some(gloo_plugin.clone())),
            );
        }
    }
    if cfg!(feature = "mpi") && skips::mpirun_or_skip() {
        for n in 1..=4 {
            specs.push(RunSpec::new("mpi", n, worker()).with_launcher(Launcher::Mpirun));
        }
    }
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
            });
            match probe.reason() {
                Some(reason) => eprintln!("{name}@{n}: not run: {reason}"),
                None => specs.push(RunSpec::new(name, n, worker())),
            }
        }
    }
    let mut matrix = Matrix::default();
    for spec in &specs {
        let w = run_world(spec);
        eprintln!(
            "{}: {} ms{}",
            w.label,
            w.millis,
            w.error
                .as_deref()
                .map(|e| format!(" ERROR {e}"))
                .unwrap_or_default()
        );
        matrix.worlds.push(w);
    }
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
