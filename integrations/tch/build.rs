//! Embed libtorch's lib directory as an rpath of this crate's tests, pass it
//! on (`DEP_ACCEL_TCH_LIBTORCH_LIB`) to dependents that build binaries, and
//! compile the C++ shim against the headers of that libtorch: what tch's C
//! API lacks (`csrc/autocast.cpp`: per-device autocast switches;
//! `csrc/grad_hooks.cpp`: gradient-accumulator hooks, a gradient set to
//! none; `csrc/tp.cpp`: the tensor-parallel autograd functions).
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-changed=csrc/autocast.cpp");
    println!("cargo:rerun-if-changed=csrc/grad_hooks.cpp");
    println!("cargo:rerun-if-changed=csrc/tp.cpp");
    println!("cargo:rerun-if-changed=csrc/shim.h");
    let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("torch-sys did not say where libtorch is (DEP_TCH_LIBTORCH_LIB); build with `source .accel-cache/tch/env.sh` (make tch-setup)");
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    println!("cargo:libtorch_lib={dir}");
    let root = std::path::Path::new(&dir)
        .parent()
        .expect("libtorch's lib directory has a parent")
        .to_path_buf();
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    cc::Build::new()
        .cpp(true)
        .file("csrc/autocast.cpp")
        .file("csrc/grad_hooks.cpp")
        .file("csrc/tp.cpp")
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++20")
        .flag_if_supported("-Wno-unused-parameter")
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .compile("accel_tch_shim");
}
