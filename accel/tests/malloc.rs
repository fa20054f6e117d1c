//! `ACCEL_MALLOC` (ADR 0038): once a model is prepared, glibc's allocator
//! keeps the memory the process frees, unless `system` says not to.
//! No libtest harness: the checks run on the main thread, whose arena is
//! the one the setting covers for blocks of 64 MiB (another thread's arena
//! still maps them), one after another, so that nothing else reads the
//! variable while it changes.

mod common;

use common::{single, Linear};

/// Blocks glibc serves with a mapping of their own.
fn mapped_blocks() -> usize {
    // SAFETY: mallinfo2 only reads glibc's allocator statistics.
    unsafe { libc::mallinfo2() }.hblks
}

/// How many more mapped blocks a 64 MiB buffer (a 4096 x 4096 f32
/// gradient) adds while it lives.
fn mapped_by_a_large_buffer() -> usize {
    let before = mapped_blocks();
    let v = std::hint::black_box(vec![1.0f32; 4096 * 4096]);
    let during = mapped_blocks();
    assert_eq!(v[4096 * 4096 - 1], 1.0);
    during.saturating_sub(before)
}

fn main() {
    let acc = single();
    std::env::set_var("ACCEL_MALLOC", "bogus");
    let e = acc
        .prepare_model(Linear::new(3))
        .expect_err("an unknown value is refused")
        .to_string();
    assert!(
        e.contains("ACCEL_MALLOC") && e.contains("bogus") && e.contains("system"),
        "{e}"
    );

    std::env::set_var("ACCEL_MALLOC", "system");
    acc.prepare_model(Linear::new(3))
        .expect("system is a valid choice");
    assert_eq!(
        mapped_by_a_large_buffer(),
        1,
        "glibc's own settings map a 64 MiB block"
    );

    std::env::remove_var("ACCEL_MALLOC");
    acc.prepare_model(Linear::new(3)).expect("the default");
    assert_eq!(
        mapped_by_a_large_buffer(),
        0,
        "after prepare_model a 64 MiB block comes from the heap"
    );
    // Freed and taken again: the heap kept it (no new mapping either).
    assert_eq!(mapped_by_a_large_buffer(), 0);
    println!("malloc: freed memory stays in the heap unless ACCEL_MALLOC=system ... ok");
}
