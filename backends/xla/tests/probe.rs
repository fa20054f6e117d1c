//! The probe never crashes: a missing file, a file that is not a shared
//! object and a shared object that is not a PJRT plugin are each
//! unavailable with the reason; the real plugin (when fetched) is available
//! with its API version and device count. One test: it sets
//! ACCEL_PJRT_PLUGIN, which is process-wide.

mod common;

use accel_api::{Backend, ErrorKind, ProbeContext};
use accel_backend_xla::BACKEND;

fn probe_reason(ctx: &ProbeContext) -> Option<String> {
    BACKEND.probe(ctx).reason().map(str::to_string)
}

/// A shared object of this system that exports no `GetPjrtApi`.
/// A single-machine run of `n` rank processes (not started by mpirun).
fn local(n: usize) -> ProbeContext {
    ProbeContext {
        world_size: n,
        local_world_size: n,
        mpi_launched: false,
        ranks_in_process: 1,
    }
}

fn some_other_library() -> Option<std::path::PathBuf> {
    [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/lib64/libm.so.6",
        "/lib/aarch64-linux-gnu/libm.so.6",
    ]
    .iter()
    .map(std::path::PathBuf::from)
    .find(|p| p.is_file())
}

#[test]
fn bad_plugins_are_unavailable_with_the_reason_and_the_real_one_is_available() {
    let one = ProbeContext::single_process();
    let dir = std::env::temp_dir().join(format!("accel-xla-probe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let missing = dir.join("missing.so");
    std::env::set_var("ACCEL_PJRT_PLUGIN", &missing);
    let reason = probe_reason(&one).expect("a missing plugin is unavailable");
    assert!(
        reason.contains("missing.so") && reason.contains("no such file"),
        "{reason}"
    );
    let e = accel_backend_xla::describe_plugin().unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Unavailable, "{e}");
    assert!(e.fix().unwrap().contains("make pjrt-setup"), "{e}");

    let text = dir.join("not-a-library.so");
    std::fs::write(&text, "this is not an ELF file\n").unwrap();
    std::env::set_var("ACCEL_PJRT_PLUGIN", &text);
    let reason = probe_reason(&one).expect("a text file is unavailable");
    assert!(reason.contains("cannot load the PJRT plugin"), "{reason}");

    match some_other_library() {
        Some(lib) => {
            std::env::set_var("ACCEL_PJRT_PLUGIN", &lib);
            let reason = probe_reason(&one).expect("libm is no PJRT plugin");
            assert!(
                reason.contains("not a PJRT plugin (no GetPjrtApi)"),
                "{reason}"
            );
        }
        None => eprintln!("no libm.so.6 found: the not-a-PJRT-library case is skipped"),
    }
    std::env::remove_var("ACCEL_PJRT_PLUGIN");
    std::fs::remove_dir_all(&dir).unwrap();

    if !common::plugin_or_skip("the real plugin's probe") {
        return;
    }
    let p = BACKEND.probe(&one);
    assert!(p.is_available(), "{p:?}");
    assert_eq!(
        p.device_count,
        accel_backend_xla::__test::DEFAULT_CPU_DEVICES
    );
    let v = p.engine_version.unwrap();
    assert!(
        v.starts_with("PJRT API 0.") && v.contains("plugin /"),
        "{v}"
    );
    // Several processes cannot share one XLA program: unavailable unless the
    // ranks are threads.
    let four = local(4);
    let reason = probe_reason(&four).expect("multi-process runs are unavailable");
    let needed = format!("{}=threads", accel_api::worker::keys::ACCEL_PROCESS_MODEL);
    assert!(reason.contains(&needed), "{reason}");
    // Available when the probe context counts the run's ranks in this
    // process (what accel::Threads passes), without the variable.
    let threads = ProbeContext {
        ranks_in_process: 4,
        ..local(4)
    };
    assert!(probe_reason(&threads).is_none());
    std::env::set_var(accel_backend_xla::__test::PROCESS_MODEL_VAR, "threads");
    assert!(probe_reason(&four).is_none());
    let many = local(100);
    let reason = probe_reason(&many).expect("more ranks than devices");
    assert!(reason.contains("ACCEL_PJRT_CPU_DEVICES=100"), "{reason}");
    std::env::remove_var(accel_backend_xla::__test::PROCESS_MODEL_VAR);
}
