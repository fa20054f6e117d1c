//! Embed libtorch's lib directory as an rpath of this crate's tests, and pass
//! it on (`DEP_ACCEL_TCH_LIBTORCH_LIB`) to dependents that build binaries.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        println!("cargo:libtorch_lib={dir}");
    }
}
