//! The probe on machines without a usable GPU, in child processes (the
//! loader reads `LD_LIBRARY_PATH` only at start): no driver library, stub
//! drivers built here with `cc` (one whose `cuInit` says
//! CUDA_ERROR_NO_DEVICE, one missing a symbol, one that "works" with no
//! NCCL next to it), a `libnccl.so.2`-only install, and a stub NCCL. The
//! stubs test accel's glue (what the probe reads and says); they never
//! count as the backend working.
//!
//! Every child must print no panic message on stderr.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const CHILD: &str = "ACCEL_NCCL_PROBE_CHILD";
const MARK: &str = "PROBE-JSON ";

/// In a child: print the probe as one marked JSON line.
#[test]
fn child_probe() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let r = accel_backend_cuda_nccl::inspect();
    let p = r.to_probe();
    println!(
        "{MARK}{}",
        serde_json::json!({
            "available": p.is_available(),
            "reason": p.reason(),
            "devices": p.device_count,
            "version": p.engine_version,
        })
    );
}

struct Outcome {
    json: serde_json::Value,
    stderr: String,
}

/// Run `child_probe` in a child with `LD_LIBRARY_PATH=lib_dir` and `envs`.
fn probe_in_child(lib_dir: &Path, envs: &[(&str, &str)]) -> Outcome {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new("timeout");
    cmd.arg("60")
        .arg(exe)
        .args(["--exact", "child_probe", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", lib_dir)
        .env_remove("ACCEL_NCCL_LIB")
        .env_remove("CUDA_VISIBLE_DEVICES")
        // No pip or distribution NCCL found by accident.
        .env("HOME", lib_dir)
        .env_remove("VIRTUAL_ENV")
        .env_remove("CONDA_PREFIX");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the test binary as a child");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "child failed: {stdout}\n{stderr}");
    let line = stdout
        .lines()
        .find_map(|l| after(l, MARK))
        .unwrap_or_else(|| panic!("no probe line in: {stdout}\n{stderr}"));
    Outcome {
        json: serde_json::from_str(line).unwrap(),
        stderr,
    }
}

/// The rest of `line` after `mark` (the test harness prints its own
/// prefix on the same line).
fn after<'a>(line: &'a str, mark: &str) -> Option<&'a str> {
    line.find(mark).map(|i| line[i + mark.len()..].trim_end())
}

fn assert_quiet(o: &Outcome) {
    assert!(
        !o.stderr.contains("panicked"),
        "a panic message reached stderr: {}",
        o.stderr
    );
}

fn reason(o: &Outcome) -> String {
    assert_eq!(o.json["available"], false, "{}", o.json);
    o.json["reason"].as_str().unwrap().to_string()
}

/// Build `lib/<name>` from C source with the system C compiler (`$CC` or
/// `cc`).
fn build_stub(dir: &Path, name: &str, source: &str) -> PathBuf {
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source).unwrap();
    let lib = dir.join(name);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(&cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}` to build a stub: {e}"));
    assert!(st.success(), "{cc} failed on {}", src.display());
    lib
}

/// A driver stub whose entry points answer as given.
fn driver_stub(dir: &Path, init: i32, count: i32, all_symbols: bool) {
    let mut src = format!(
        "int cuInit(unsigned f) {{ (void)f; return {init}; }}\n\
         int cuDeviceGetCount(int *n) {{ *n = {count}; return 0; }}\n\
         int cuDriverGetVersion(int *v) {{ *v = 13000; return 0; }}\n"
    );
    if all_symbols {
        // The probe's own three are defined above.
        for s in accel_backend_cuda_nccl::__test::required_driver_symbols()
            .iter()
            .filter(|s| !src.contains(&format!("int {s}(")))
            .collect::<Vec<_>>()
        {
            src.push_str(&format!("int {s}(void) {{ return 999; }}\n"));
        }
    } else {
        src = src.replace(
            "int cuDriverGetVersion(int *v) { *v = 13000; return 0; }\n",
            "",
        );
    }
    build_stub(dir, "libcuda.so", &src);
}

/// The probe's reason over a driver stub that answers as given
/// ([`driver_stub`]) and no NCCL, run with `envs`.
fn driver_reason(init: i32, count: i32, all_symbols: bool, envs: &[(&str, &str)]) -> String {
    let t = tempfile::tempdir().unwrap();
    driver_stub(t.path(), init, count, all_symbols);
    let o = probe_in_child(t.path(), envs);
    assert_quiet(&o);
    reason(&o)
}

#[test]
fn no_driver_library_is_a_reason_not_a_panic() {
    let t = tempfile::tempdir().unwrap();
    let o = probe_in_child(t.path(), &[]);
    assert_quiet(&o);
    if o.json["available"] == true || !reason(&o).contains("libcuda.so") {
        // A real driver is installed system-wide: this case cannot be made.
        accel_test_support::skips::skip_absent_hardware(&format!(
            "this machine has a system libcuda ({})",
            o.json
        ));
        return;
    }
    assert!(reason(&o).contains("was not found"), "{}", o.json);
    assert_eq!(o.json["devices"], 0);
}

#[test]
fn a_driver_without_devices_says_so() {
    // 100: CUDA_ERROR_NO_DEVICE.
    let why = driver_reason(100, 0, true, &[("CUDA_VISIBLE_DEVICES", "")]);
    // The error, and the mask.
    for part in ["CUDA_ERROR_NO_DEVICE", "CUDA_VISIBLE_DEVICES=\"\""] {
        assert!(why.contains(part), "`{part}` missing: {why}");
    }
}

#[test]
fn a_driver_missing_a_symbol_is_named() {
    let why = driver_reason(0, 1, false, &[]);
    assert!(why.contains("lacks cuDriverGetVersion"), "{why}");
}

#[test]
fn nccl_missing_or_only_so_2_gives_the_fix() {
    let t = tempfile::tempdir().unwrap();
    driver_stub(t.path(), 0, 2, true);
    let o = probe_in_child(t.path(), &[]);
    assert_quiet(&o);
    let why = reason(&o);
    assert!(why.contains("libnccl.so was not found"), "{why}");
    assert_eq!(
        o.json["devices"], 2,
        "devices are counted before NCCL: {}",
        o.json
    );
    assert_eq!(o.json["version"], "CUDA driver 13.0");

    // A pip-style install: only libnccl.so.2, found through ACCEL_NCCL_LIB.
    let wheel = t.path().join("wheel/nvidia/nccl/lib");
    std::fs::create_dir_all(&wheel).unwrap();
    build_stub(
        &wheel,
        "libnccl.so.2",
        "int ncclGetVersion(int *v) { *v = 22803; return 0; }\n",
    );
    let lib = wheel.join("libnccl.so.2");
    let o = probe_in_child(t.path(), &[("ACCEL_NCCL_LIB", lib.to_str().unwrap())]);
    assert_quiet(&o);
    let why = reason(&o);
    assert!(
        why.contains(&format!("installed as {}", lib.display())),
        "{why}"
    );
    assert!(why.contains("LD_LIBRARY_PATH"), "{why}");
}

#[test]
fn the_link_dir_makes_the_soname_loadable() {
    let t = tempfile::tempdir().unwrap();
    driver_stub(t.path(), 0, 1, true);
    let wheel = t.path().join("wheel");
    std::fs::create_dir_all(&wheel).unwrap();
    let mut src = String::from("int ncclGetVersion(int *v) { *v = 22803; return 0; }\n");
    let others = accel_backend_cuda_nccl::__test::required_nccl_symbols()
        .iter()
        .filter(|s| **s != "ncclGetVersion");
    for s in others {
        src.push_str(&format!("int {s}(void) {{ return 3; }}\n"));
    }
    build_stub(&wheel, "libnccl.so.2", &src);
    let links = t.path().join("links");
    // prepare_link_dir reads the environment: run it in this process with
    // the stub named explicitly through a child-free call.
    let made = link_dir_for(&wheel.join("libnccl.so.2"), &links);
    assert_eq!(made.as_deref(), Some(links.as_path()));
    let path = format!("{}:{}", links.display(), t.path().display());
    let o = probe_in_child(Path::new(&path), &[]);
    assert_quiet(&o);
    assert_eq!(o.json["available"], true, "{}", o.json);
    assert_eq!(o.json["devices"], 1);
    assert_eq!(o.json["version"], "NCCL 2.28.3, CUDA driver 13.0");
}

/// `prepare_link_dir` in a child, with `ACCEL_NCCL_LIB` pointing at `lib`.
fn link_dir_for(lib: &Path, into: &Path) -> Option<PathBuf> {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("timeout")
        .arg("60")
        .arg(exe)
        .args([
            "--exact",
            "child_link_dir",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ACCEL_NCCL_LINK_CHILD", into)
        .env("ACCEL_NCCL_LIB", lib)
        .env("LD_LIBRARY_PATH", "")
        .env("HOME", into)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}");
    stdout
        .lines()
        .find_map(|l| after(l, "LINK-DIR "))
        .and_then(|s| (s != "none").then(|| PathBuf::from(s)))
}

#[test]
fn child_link_dir() {
    let Some(into) = std::env::var_os("ACCEL_NCCL_LINK_CHILD") else {
        return;
    };
    let made = accel_backend_cuda_nccl::prepare_link_dir(Path::new(&into)).unwrap();
    match made {
        Some(d) => println!("LINK-DIR {}", d.display()),
        None => println!("LINK-DIR none"),
    }
}

#[test]
fn connect_without_a_driver_is_unavailable_with_the_reason() {
    if accel_backend_cuda_nccl::inspect().unavailable.is_none() {
        accel_test_support::skips::skip_absent_hardware(
            "CUDA and NCCL are usable here (tests/gpu.rs covers it)",
        );
        return;
    }
    let store: std::sync::Arc<dyn accel_api::Store> =
        std::sync::Arc::new(accel_rendezvous::MemoryStore::new());
    let ctx = accel_api::ConnectContext {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        local_world_size: 1,
        device: accel_api::Device::new(accel_api::DeviceKind::Cuda, 0),
        timeout: Duration::from_secs(5),
        store,
        run_id: "t".into(),
    };
    let e = accel_backend_cuda_nccl::__test::connect(ctx).unwrap_err();
    assert_eq!(e.kind(), &accel_api::ErrorKind::Unavailable, "{e}");
    assert!(
        e.to_string().starts_with("[cuda-nccl rank 0] connect: "),
        "{e}"
    );
}
