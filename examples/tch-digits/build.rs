//! An rpath to libtorch's lib directory, so the binary runs without
//! `LD_LIBRARY_PATH` (torch-sys, a direct dependency, tells where it is).
//!
//! No link-order settings: cpu-gloo binds its Gloo privately (its build
//! script), so libtorch's own copy of Gloo cannot capture its calls.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
