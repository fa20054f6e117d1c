//! Compiles the C++ shim (`shim/gloo_shim.cc`) against the system Gloo and
//! links `libgloo`.
//!
//! Gloo is found in `/usr/include` and `/usr/lib` (Debian's `libgloo-dev`),
//! or where `ACCEL_GLOO_INCLUDE_DIR` (the folder holding `gloo/context.h`)
//! and `ACCEL_GLOO_LIB_DIR` (the folder holding `libgloo.so`) point. When it
//! is missing the build stops with one line saying how to install it.

use std::path::PathBuf;
use std::process::Command;

const MISSING: &str =
    "accel-backend-cpu-gloo needs Gloo: run 'apt-get install libgloo-dev' (or make setup)";

fn fail(detail: &str) -> ! {
    // One clear line; the detail says which file was looked for where.
    eprintln!("{MISSING} ({detail})");
    std::process::exit(1);
}

fn env_dir(var: &str) -> Option<PathBuf> {
    println!("cargo:rerun-if-env-changed={var}");
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn find_include() -> PathBuf {
    let candidates: Vec<PathBuf> = match env_dir("ACCEL_GLOO_INCLUDE_DIR") {
        Some(d) => vec![d],
        None => vec!["/usr/include".into(), "/usr/local/include".into()],
    };
    for d in &candidates {
        if d.join("gloo/context.h").is_file() && d.join("gloo/config.h").is_file() {
            return d.clone();
        }
    }
    fail(&format!(
        "no gloo/context.h under {}",
        join_paths(&candidates)
    ))
}

fn find_lib() -> PathBuf {
    let candidates: Vec<PathBuf> = match env_dir("ACCEL_GLOO_LIB_DIR") {
        Some(d) => vec![d],
        None => {
            let mut v: Vec<PathBuf> = vec!["/usr/lib".into()];
            if let Ok(arch) = std::env::var("CARGO_CFG_TARGET_ARCH") {
                let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
                let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
                v.push(format!("/usr/lib/{arch}-{os}-{env}").into());
            }
            v.push("/usr/local/lib".into());
            v
        }
    };
    for d in &candidates {
        if d.join("libgloo.so").exists() {
            return d.clone();
        }
    }
    fail(&format!("no libgloo.so under {}", join_paths(&candidates)))
}

fn join_paths(v: &[PathBuf]) -> String {
    v.iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The Debian package version, when dpkg knows it (reported by the probe).
fn package_version() -> String {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Version}", "libgloo-dev"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_default()
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let shim = manifest.join("shim");
    println!(
        "cargo:rerun-if-changed={}",
        shim.join("gloo_shim.cc").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        shim.join("gloo_shim.h").display()
    );
    println!("cargo:rerun-if-changed=build.rs");

    let include = find_include();
    let lib = find_lib();

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .file(shim.join("gloo_shim.cc"))
        .include(&shim)
        .include(&include)
        // The reduction kernels Gloo calls (gloo::sum<T> and friends) are
        // templates instantiated in this shim: compile them optimised even
        // in debug builds, or a debug build reduces 1.3-1.6x slower and
        // benchmarks of debug binaries mislead. -O3, not -O2: GCC 12 at -O2
        // does not vectorize `c[i] = a[i] + b[i]` (the loop needs a runtime
        // aliasing check, which -O2's cost model refuses), and the scalar
        // loop is 3.5-4x slower (150 vs 38 us for 1 MiB of f32 here), the
        // best-vs-best gap to raw Gloo (built -O3) in docs/benchmarks.md.
        .opt_level(3)
        // Gloo's reductions are templates instantiated here: make signed
        // integer overflow wrap (two's complement) instead of being UB.
        .flag_if_supported("-fwrapv")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-sign-compare")
        .warnings(true);
    build.compile("accel_gloo_shim");

    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=gloo");
    println!("cargo:rustc-link-lib=dylib=pthread");
    println!("cargo:include={}", include.display());
    println!("cargo:lib={}", lib.display());
    println!(
        "cargo:rustc-env=ACCEL_GLOO_PACKAGE_VERSION={}",
        package_version()
    );
}
