//! A relative `ACCEL_PLUGIN_PATH` entry names a file in the current
//! directory, never a library found on the loader's search path (issue 22,
//! item 9: `ACCEL_PLUGIN_PATH=libz.so` loaded the system's libz).
//!
//! One test in this file: it changes the process's current directory.

use accel::Registry;

#[test]
fn a_relative_plugin_entry_is_the_file_in_the_current_directory() {
    let dir = tempfile::tempdir().unwrap();
    // Not a shared object: loading the file here must fail on its content.
    std::fs::write(dir.path().join("libz.so"), b"not an ELF file").unwrap();
    std::env::set_current_dir(dir.path()).unwrap();
    let here = std::env::current_dir().unwrap();

    // `libz.so` is on the library path of most systems, and `libc.so.6` of
    // every glibc one: neither may be what gets loaded.
    let mut r = Registry::empty();
    r.load_plugins("libz.so:libc.so.6");
    let failures = r.plugin_failures();
    assert_eq!(failures.len(), 2, "{failures:#?}");

    let z = &failures[0];
    assert_eq!(z.path, here.join("libz.so"), "{failures:#?}");
    assert!(
        !z.reason.contains("accel_plugin_entry") && !z.reason.contains("does not export"),
        "the system's libz was opened instead of ./libz.so: {}",
        z.reason
    );

    let c = &failures[1];
    assert_eq!(c.path, here.join("libc.so.6"), "{failures:#?}");
    assert!(
        !c.reason.contains("does not export"),
        "the system's libc was opened instead of ./libc.so.6: {}",
        c.reason
    );
    assert!(r.entries().is_empty());
}
