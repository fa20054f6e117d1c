//! Link settings for a binary that uses both libtorch and accel's cpu-gloo.
//!
//! * An rpath to libtorch's lib directory, so the binary runs without
//!   `LD_LIBRARY_PATH` (torch-sys, a direct dependency, tells where it is).
//! * The system Gloo ahead of libtorch in the dynamic linker's search order.
//!   libtorch_cpu.so carries its own copy of Gloo and exports its symbols;
//!   when it is loaded first, the cpu-gloo shim's calls bind to libtorch's
//!   Gloo (another version, another ABI) and crash. This crate's own
//!   libraries come first on the linker's command line, so linking libgloo
//!   here, together with a reference from `main.rs`'s object code (the
//!   linker passes `--as-needed`: an unreferenced library is not recorded),
//!   puts libgloo ahead of libtorch_cpu in the binary's `DT_NEEDED` list, and
//!   every `gloo::` symbol resolves to the library the shim was built for.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=DEP_GLOO_LIB");
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    if let Ok(dir) = std::env::var("DEP_GLOO_LIB") {
        println!("cargo:rustc-link-search=native={dir}");
    }
    println!("cargo:rustc-link-lib=dylib=gloo");
}
