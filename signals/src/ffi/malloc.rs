//! glibc's allocator, set to keep the memory a program frees (ADR 0038).

/// Freed memory at the heap's top that glibc keeps instead of returning it.
const KEEP_BYTES: libc::c_int = 512 << 20;

/// `mallopt(M_MMAP_MAX, 0)` and `mallopt(M_TRIM_THRESHOLD, 512 MiB)`;
/// whether glibc took both.
#[cfg(target_env = "gnu")]
pub(crate) fn keep_freed_memory() -> bool {
    // SAFETY: mallopt only changes glibc's allocator parameters, under its
    // own lock; a block already handed out keeps its provenance (a mapped
    // one is still unmapped when freed).
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, KEEP_BYTES) == 1
    }
}

#[cfg(not(target_env = "gnu"))]
pub(crate) fn keep_freed_memory() -> bool {
    false
}
