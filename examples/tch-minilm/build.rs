//! An rpath to libtorch's lib directory, so the binary and the tests run
//! without `LD_LIBRARY_PATH` (torch-sys, a direct dependency, tells where).
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
