//! The crate's one `unsafe` call: memory-mapping a file read-only.
#![allow(unsafe_code)]

use std::fs::File;
use std::path::Path;

use accel_api::{Error, Result};
use memmap2::Mmap;

/// Map `file` (opened from `path`, which only names it in errors) read-only.
///
/// With `populate`, the kernel reads the whole file in at map time
/// (`MAP_POPULATE`), sparing one page fault per 4 KiB during a full scan.
pub(crate) fn map_readonly(file: &File, path: &Path) -> Result<Mmap> {
    map_with(file, path, false)
}

/// [`map_readonly`], optionally pre-faulting every page.
pub(crate) fn map_with(file: &File, path: &Path, populate: bool) -> Result<Mmap> {
    let mut opts = memmap2::MmapOptions::new();
    if populate {
        opts.populate();
    }
    // SAFETY: `Mmap::map` is unsafe because another process could truncate or
    // rewrite the file while it is mapped, which Rust cannot see. accel opens
    // every mapped file read-only and treats it as immutable: offload files
    // are only ever replaced by writing a new file and renaming it over the
    // old name (the old inode, and so this mapping, stays intact), never
    // modified in place. Checkpoints are inputs that users must not edit
    // while accel reads them, as with every other loader.
    let map = unsafe { opts.map(file) };
    map.map_err(|e| Error::io(format!("mmap {}", path.display()), e))
}
