//! A counting global allocator: the bytes this process holds on Rust's
//! heap now and the most it held since the last [`reset_peak`].
//!
//! Only what goes through Rust's allocator counts: memory a C or C++
//! library takes with `malloc` itself (Gloo's transport buffers) does not.
//! The binary installs it with `#[global_allocator]`; in any other binary
//! the counters stay at 0.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = CURRENT.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

fn shrank(by: usize) {
    CURRENT.fetch_sub(by, Ordering::Relaxed);
}

/// The system allocator, counting the bytes it hands out and takes back.
#[derive(Debug, Default)]
pub struct Counting;

// SAFETY: every method forwards its arguments unchanged to `System`, which
// upholds `GlobalAlloc`'s contract; the counters are atomics that neither
// allocate nor panic (the subtraction cannot underflow: only bytes counted
// in are counted out).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's `layout` contract is passed on as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` was allocated by `System` with `layout`; the
        // caller's contract on `new_size` is passed on.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                shrank(layout.size() - new_size);
            }
        }
        p
    }
}

/// Bytes held on the heap now.
pub fn current() -> usize {
    CURRENT.load(Ordering::Relaxed)
}

/// The most bytes held since the last [`reset_peak`] (or the start).
pub fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Start a new peak from what is held now.
pub fn reset_peak() {
    PEAK.store(current(), Ordering::Relaxed);
}
