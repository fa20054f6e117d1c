//! # accel-signals: what a worker process says when it is killed by its own hand
//!
//! (And one more process-wide setting the facade cannot make without
//! `unsafe`: [`keep_freed_memory`], glibc's allocator keeping freed memory.)
//!
//! A process that hosts ranks as threads (xla, or `ACCEL_PROCESS_MODEL=threads`)
//! dies as a whole when one thread calls `abort()`: a C library's failed check,
//! `std::process::abort`, a double panic. Rust prints nothing for a bare
//! abort, so the launcher could not tell which rank failed. With
//! [`name_aborting_rank_threads`] installed, the aborting thread writes one
//! line to stderr before the process dies:
//!
//! ```text
//! thread 'rank 3' aborted (SIGABRT)
//! ```
//!
//! the same shape as Rust's own `thread 'rank 3' panicked at` and
//! `thread 'rank 3' has overflowed its stack`, which the launcher already
//! reads. Only a thread named `rank N` (as accel names rank threads) writes
//! it, and only for an abort raised inside the process: a SIGABRT sent from
//! outside (`kill -ABRT`) lands on an arbitrary thread and names nobody.
//!
//! The handler lives in this small crate because the facade and accel-api
//! forbid `unsafe` (ADR 0024); here it is confined to the `ffi` module.
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
mod ffi;

/// Install, once per process, a SIGABRT handler that makes an aborting
/// rank thread name itself on stderr (see the crate docs).
///
/// Leaves a handler the program installed itself in place (then returns
/// `false`). The handler resets itself on entry, so the process still dies
/// by SIGABRT with its usual exit status. On targets other than Linux it
/// does nothing and returns `false`.
///
/// Returns whether the hook is installed after the call.
pub fn name_aborting_rank_threads() -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::sync::OnceLock;
        static INSTALLED: OnceLock<bool> = OnceLock::new();
        *INSTALLED.get_or_init(ffi::install)
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// Once per process, tell glibc's allocator to keep the memory the program
/// frees: every block from glibc's heaps instead of a mapping of its own
/// (`mallopt(M_MMAP_MAX, 0)`), and up to 512 MiB freed at a heap's top kept
/// (`M_TRIM_THRESHOLD`). Without it glibc maps each block above 32 MiB
/// afresh and unmaps it when freed, so a training loop whose gradients
/// are larger faults in and zeroes every page of them on every backward
/// (docs/adr/0038). Blocks of 64 MiB or more still get a mapping of their
/// own on threads other than the main one (glibc's other arenas are heaps
/// of at most 64 MiB).
///
/// Returns whether glibc took the settings (`false` on other C libraries
/// and targets, where nothing changes).
pub fn keep_freed_memory() -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::sync::OnceLock;
        static KEPT: OnceLock<bool> = OnceLock::new();
        *KEPT.get_or_init(ffi::malloc::keep_freed_memory)
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// The line written for an aborting thread named `name`, into `out`;
/// returns its length, or `None` for a thread that is not a rank thread.
/// Writes only into `out` (no allocation: it runs in a signal handler).
pub(crate) fn abort_line(name: &[u8], out: &mut [u8; 64]) -> Option<usize> {
    const HEAD: &[u8] = b"thread '";
    const TAIL: &[u8] = b"' aborted (SIGABRT)\n";
    let digits = name.strip_prefix(b"rank ")?;
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let len = HEAD.len() + name.len() + TAIL.len();
    if len > out.len() {
        return None;
    }
    let mut at = 0;
    for part in [HEAD, name, TAIL] {
        out[at..at + part.len()].copy_from_slice(part);
        at += part.len();
    }
    Some(len)
}

#[cfg(test)]
mod tests {
    use super::abort_line;

    fn line(name: &str) -> Option<String> {
        let mut out = [0u8; 64];
        abort_line(name.as_bytes(), &mut out).map(|n| String::from_utf8_lossy(&out[..n]).into())
    }

    #[test]
    fn only_rank_threads_name_themselves() {
        assert_eq!(
            line("rank 12").as_deref(),
            Some("thread 'rank 12' aborted (SIGABRT)\n")
        );
        assert_eq!(line("rank 4294967295").as_deref().map(str::len), Some(43));
        for other in ["main", "rank ", "rank x", "rank 1a", "ranks 1", ""] {
            assert_eq!(line(other), None, "{other:?}");
        }
    }
}
