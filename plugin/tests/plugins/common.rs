//! Shared helpers: build the fixture cdylibs, compile C fixtures, bound a
//! test's run time.
//!
//! # How the tests find the plugins
//!
//! The plugins are workspace members (`accel-vendor-plugin`,
//! `accel-plugin-fixture`), but `cargo test -p accel-plugin` does not build
//! them and even `cargo test --workspace` need not produce their `.so` (it
//! builds cdylib crates as test harnesses). So the first test that needs
//! them runs `cargo build -p accel-vendor-plugin -p accel-plugin-fixture
//! --message-format=json` once per test process, in the same target
//! directory as this test (the parent of `CARGO_TARGET_TMPDIR`; cargo
//! releases its lock before running tests), and takes the exact `.so` paths
//! from cargo's `compiler-artifact` messages. An up-to-date build takes a
//! fraction of a second; the build is bounded by [`BUILD_LIMIT`].
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The bound on building the fixture plugins (a cold build on a small
/// machine compiles serde and friends).
pub const BUILD_LIMIT: Duration = Duration::from_secs(600);

/// The bound on one test's own work, once the plugins are built.
pub const TEST_LIMIT: Duration = Duration::from_secs(60);

/// The built plugins.
#[derive(Debug)]
pub struct Plugins {
    /// `examples/vendor-plugin`: backend `vendor-single`.
    pub vendor: PathBuf,
    /// `examples/plugin-fixture`: backend `fixture`.
    pub fixture: PathBuf,
}

/// Build (once per process) and locate the plugin cdylibs.
pub fn plugins() -> &'static Plugins {
    static PLUGINS: OnceLock<Plugins> = OnceLock::new();
    PLUGINS.get_or_init(build_plugins)
}

fn build_plugins() -> Plugins {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("plugin/ has a parent")
        .to_path_buf();
    let target_dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("CARGO_TARGET_TMPDIR is inside the target directory")
        .to_path_buf();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut child = Command::new(cargo)
        .arg("build")
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        .args([
            "-p",
            "accel-vendor-plugin",
            "-p",
            "accel-plugin-fixture",
            "--message-format=json-render-diagnostics",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run cargo to build the fixture plugins");
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + BUILD_LIMIT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for cargo") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("building the fixture plugins took more than {BUILD_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = out.join().unwrap();
    let err = err.join().unwrap();
    assert!(
        status.success(),
        "building the fixture plugins failed ({status}):\n{err}"
    );
    let mut vendor = None;
    let mut fixture = None;
    for line in out.lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        let is_cdylib = msg["target"]["kind"]
            .as_array()
            .is_some_and(|k| k.iter().any(|k| k == "cdylib"));
        if !is_cdylib {
            continue;
        }
        let so = msg["filenames"].as_array().and_then(|f| {
            f.iter()
                .filter_map(|f| f.as_str())
                .find(|f| f.ends_with(std::env::consts::DLL_SUFFIX))
                .map(PathBuf::from)
        });
        match msg["target"]["name"].as_str() {
            Some("accel_vendor_plugin") => vendor = so,
            Some("accel_plugin_fixture") => fixture = so,
            _ => {}
        }
    }
    Plugins {
        vendor: vendor.unwrap_or_else(|| panic!("cargo reported no vendor plugin:\n{err}")),
        fixture: fixture.unwrap_or_else(|| panic!("cargo reported no fixture plugin:\n{err}")),
    }
}

/// Run `f` on its own thread and fail the test when it takes longer than
/// `limit` (collectives and loaders can hang; a test must not).
pub fn bounded<F: FnOnce() + Send + 'static>(limit: Duration, f: F) {
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(limit) {
        Ok(()) => worker.join().unwrap(),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            // The closure panicked: fail with its message.
            if let Err(p) = worker.join() {
                std::panic::resume_unwind(p)
            }
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("test exceeded its {limit:?} bound")
        }
    }
}

/// Build the plugins (bounded), then run `f` bounded by [`TEST_LIMIT`].
pub fn with_plugins<F: FnOnce(&'static Plugins) + Send + 'static>(f: F) {
    bounded(BUILD_LIMIT, || {
        plugins();
    });
    bounded(TEST_LIMIT, move || f(plugins()));
}

/// Compile `source` (C) into the shared object `dir/name`.
pub fn compile_c(dir: &Path, name: &str, source: &str) -> PathBuf {
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source).unwrap();
    let out = dir.join(name);
    let cc = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
    let result = Command::new(&cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(&out)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("these tests need a C compiler ({cc:?}, or set CC): {e}"));
    assert!(
        result.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&result.stderr)
    );
    out
}

/// A C plugin whose entry returns a table header with the given size and
/// version (and zeroed function pointers after it).
pub fn c_table(struct_size: &str, major: u32, minor: u32) -> String {
    format!(
        r#"#include <stddef.h>
#include <stdint.h>
struct table {{ size_t struct_size; uint32_t abi_major; uint32_t abi_minor; void *rest[32]; }};
static const struct table t = {{ {struct_size}, {major}, {minor}, {{0}} }};
const void *accel_plugin_entry_v1(void) {{ return &t; }}
"#
    )
}

/// The error of `r`, which must have failed.
pub fn err<T>(r: accel_api::Result<T>) -> accel_api::Error {
    match r {
        Ok(_) => panic!("expected an error, the call succeeded"),
        Err(e) => e,
    }
}
