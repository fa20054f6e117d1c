//! Compiles the C++ shim (`shim/gloo_shim.cc`) against the system Gloo into
//! a private shared object, and links trampolines that load it.
//!
//! # Private Gloo
//! libtorch_cpu.so exports its own copy of Gloo (another version, another
//! ABI). Were the shim linked into the binary with `-lgloo`, its `gloo::`
//! calls would bind to whichever copy the dynamic linker met first, and a
//! binary that loads libtorch first would crash at connect. So the shim is
//! built as `libaccel_gloo_private.so` (linked against the system libgloo,
//! exporting only the `accel_gloo_*` functions), and the crate links a small
//! generated C file instead: one trampoline per function of
//! `shim/gloo_shim.h`, which on first use opens that object with
//! `RTLD_LOCAL | RTLD_DEEPBIND`. DEEPBIND puts the object's own dependency
//! tree (the system libgloo) ahead of the global scope, so the shim's Gloo
//! symbols resolve to the library it was compiled against whatever else
//! the process loaded, and the binary itself no longer names libgloo at
//! all. The object's path is compiled in (this build's `OUT_DIR`, as
//! libtorch's rpath is); `ACCEL_GLOO_SHIM_LIB` names another copy at run
//! time. When it cannot be opened, every call fails with the loader's
//! message (the probe reports it).
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
        .pic(true)
        .file(shim.join("gloo_shim.cc"))
        .include(&shim)
        .include(&include)
        // The reduction kernels Gloo calls for every chunk are the shim's
        // own templates: compile them optimised even in debug builds, or a
        // debug build reduces 1.3-1.6x slower and benchmarks of debug
        // binaries mislead. -O3, not -O2: GCC 12 at -O2 does not vectorize
        // `c[i] = a[i] + b[i]` (the loop needs a runtime aliasing check,
        // which -O2's cost model refuses). No -fwrapv: it kept Gloo's own
        // kernels (an `int` counter) scalar, 3-4x slower, the best-vs-best
        // gap to raw Gloo in docs/benchmarks.md; the shim's kernels wrap
        // integers through unsigned arithmetic instead (gloo_shim.cc).
        .opt_level(3)
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-sign-compare")
        .warnings(true);
    // Debian's libgloo-dev lacks gloo/common/memory.h, which the TCP
    // transport's headers include (the shim derives from its unbound buffer).
    if !include.join("gloo/common/memory.h").is_file() {
        build.include(shim.join("compat"));
    }
    println!(
        "cargo:rerun-if-changed={}",
        shim.join("compat/gloo/common/memory.h").display()
    );
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let objects = build.compile_intermediates();
    let private = link_private_shim(&build, &objects, &lib, &out);

    // The trampolines: what the Rust side links instead of the shim.
    let header = std::fs::read_to_string(shim.join("gloo_shim.h"))
        .unwrap_or_else(|e| panic!("reading {}: {e}", shim.join("gloo_shim.h").display()));
    let trampolines = out.join("gloo_trampolines.c");
    std::fs::write(&trampolines, trampolines_c(&header, &private))
        .unwrap_or_else(|e| panic!("writing {}: {e}", trampolines.display()));
    cc::Build::new()
        .file(&trampolines)
        .include(&shim)
        .define("_GNU_SOURCE", None)
        .warnings(true)
        .compile("accel_gloo_shim");
    println!("cargo:rustc-link-lib=dylib=dl");
    println!("cargo:rustc-link-lib=dylib=pthread");
    println!("cargo:private_shim={}", private.display());
    println!("cargo:include={}", include.display());
    println!("cargo:lib={}", lib.display());
    println!(
        "cargo:rustc-env=ACCEL_GLOO_PACKAGE_VERSION={}",
        package_version()
    );
}

/// Link the shim's objects into `OUT_DIR/libaccel_gloo_private.so` against
/// the system libgloo, exporting only the `accel_gloo_*` functions.
fn link_private_shim(
    build: &cc::Build,
    objects: &[PathBuf],
    lib: &std::path::Path,
    out: &std::path::Path,
) -> PathBuf {
    let so = out.join("libaccel_gloo_private.so");
    let script = out.join("gloo_private.map");
    std::fs::write(&script, "{\n  global: accel_gloo_*;\n  local: *;\n};\n")
        .unwrap_or_else(|e| panic!("writing {}: {e}", script.display()));
    let compiler = build.get_compiler();
    let status = compiler
        .to_command()
        .arg("-shared")
        .arg("-o")
        .arg(&so)
        .args(objects)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lgloo")
        .arg("-lpthread")
        .arg("-Wl,-soname,libaccel_gloo_private.so")
        .arg(format!("-Wl,--version-script={}", script.display()))
        .arg("-Wl,-z,defs")
        .status()
        .unwrap_or_else(|e| panic!("running the C++ compiler to link {}: {e}", so.display()));
    if !status.success() {
        fail(&format!("linking {} failed ({status})", so.display()));
    }
    so
}

/// One declaration of `gloo_shim.h`: return type, name, parameters (type,
/// name).
struct Decl {
    ret: String,
    name: String,
    params: Vec<String>,
}

/// The `accel_gloo_*` function declarations of the header.
fn declarations(header: &str) -> Vec<Decl> {
    // Drop comments and preprocessor lines, then split into statements.
    let mut text = String::new();
    let mut rest = header;
    while let Some(i) = rest.find("/*") {
        text.push_str(&rest[..i]);
        rest = rest[i..].find("*/").map_or("", |j| &rest[i + j + 2..]);
    }
    text.push_str(rest);
    let text: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.contains("extern \"C\""))
        .collect::<Vec<_>>()
        .join(" ");
    let mut out = Vec::new();
    for stmt in text.split(';') {
        let stmt = stmt.split_whitespace().collect::<Vec<_>>().join(" ");
        let Some(open) = stmt.find('(') else { continue };
        let (head, tail) = stmt.split_at(open);
        if head.contains('{') || head.contains('}') || head.contains("typedef") {
            continue;
        }
        let Some(name) = head.split([' ', '*']).rfind(|w| !w.is_empty()) else {
            continue;
        };
        if !name.starts_with("accel_gloo_") || !tail.ends_with(')') {
            continue;
        }
        let ret = head[..head.len() - name.len()].trim().to_string();
        let inner = &tail[1..tail.len() - 1];
        let params = if inner.trim() == "void" || inner.trim().is_empty() {
            Vec::new()
        } else {
            inner.split(',').map(|p| p.trim().to_string()).collect()
        };
        out.push(Decl {
            ret,
            name: name.to_string(),
            params,
        });
    }
    out
}

fn param_name(p: &str) -> &str {
    p.rsplit([' ', '*']).next().unwrap_or(p)
}

/// The trampolines' C source: each `accel_gloo_*` function of the header
/// forwards to the same function of the private object, opened once.
fn trampolines_c(header: &str, private: &std::path::Path) -> String {
    let decls = declarations(header);
    assert!(
        decls.len() >= 10 && decls.iter().any(|d| d.name == "accel_gloo_allreduce"),
        "gloo_shim.h: found only {} declarations",
        decls.len()
    );
    let path = private
        .display()
        .to_string()
        .replace('\\', "\\\\")
        .replace('"', "\\\"");
    let mut c = String::new();
    c.push_str(&format!(
        r#"/* Generated by accel-backend-cpu-gloo's build.rs from gloo_shim.h. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "gloo_shim.h"

static const char* const accel_gloo_private_path = "{path}";
static pthread_once_t accel_gloo_once = PTHREAD_ONCE_INIT;
static char accel_gloo_load_error[1024];
static struct {{
"#
    ));
    for d in &decls {
        c.push_str(&format!("  __typeof__({0})* {0};\n", d.name));
    }
    c.push_str(
        r#"} accel_gloo_fns;

static void accel_gloo_load(void) {
  const char* path = getenv("ACCEL_GLOO_SHIM_LIB");
  if (path == NULL || path[0] == '\0') path = accel_gloo_private_path;
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (h == NULL) {
    const char* e = dlerror();
    snprintf(accel_gloo_load_error, sizeof accel_gloo_load_error,
             "cpu-gloo could not open its private Gloo shim %s: %s (rebuild accel, or set ACCEL_GLOO_SHIM_LIB to a libaccel_gloo_private.so)",
             path, e ? e : "unknown error");
    return;
  }
"#,
    );
    for d in &decls {
        c.push_str(&format!(
            "  accel_gloo_fns.{0} = (__typeof__({0})*)dlsym(h, \"{0}\");\n",
            d.name
        ));
    }
    c.push_str(
        r#"}

static void accel_gloo_fail(const char* fn, char* err, size_t cap) {
  if (accel_gloo_load_error[0] == '\0') {
    snprintf(accel_gloo_load_error, sizeof accel_gloo_load_error,
             "cpu-gloo's private Gloo shim lacks %s (rebuild accel)", fn);
  }
  if (err != NULL && cap > 0) snprintf(err, cap, "%s", accel_gloo_load_error);
}

"#,
    );
    for d in &decls {
        let args: Vec<&str> = d.params.iter().map(|p| param_name(p)).collect();
        let has_err = args.contains(&"err") && args.contains(&"err_cap");
        let params = if d.params.is_empty() {
            "void".to_string()
        } else {
            d.params.join(", ")
        };
        let fallback = match d.ret.as_str() {
            "void" => "return;".to_string(),
            "int" => "return ACCEL_GLOO_E_UNKNOWN;".to_string(),
            "size_t" => "return 0;".to_string(),
            "const char*" => "return accel_gloo_load_error;".to_string(),
            other => panic!(
                "gloo_shim.h: no trampoline fallback for return type {other:?} of {}",
                d.name
            ),
        };
        let call = format!("accel_gloo_fns.{}({})", d.name, args.join(", "));
        let body = if d.ret == "void" {
            format!("{call};")
        } else {
            format!("return {call};")
        };
        c.push_str(&format!(
            "{ret} {name}({params}) {{\n  pthread_once(&accel_gloo_once, accel_gloo_load);\n  if (accel_gloo_fns.{name} == NULL) {{\n    accel_gloo_fail(\"{name}\", {err});\n    {fallback}\n  }}\n  {body}\n}}\n\n",
            ret = d.ret,
            name = d.name,
            err = if has_err { "err, err_cap" } else { "NULL, 0" },
        ));
    }
    c
}
