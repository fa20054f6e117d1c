//! Durable writes: one file replaced atomically (temporary file in the
//! same directory, fsync, rename, directory fsync), for every crate that
//! writes a file others read while it may be rewritten.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Error, Result};

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Write `path` atomically: a temporary file in the same directory, written
/// by `fill`, fsynced, renamed over `path`, then the directory fsynced.
/// Readers see the old file or the new one, never a torn one.
///
/// # Errors
/// [`ErrorKind::Io`](crate::ErrorKind::Io) naming `path` (the temporary file is
/// removed).
pub fn write_atomic(
    path: &Path,
    fill: impl FnOnce(&mut std::io::BufWriter<&File>) -> std::io::Result<()>,
) -> Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp: PathBuf = dir.join(format!(
        ".{file_name}.tmp-{}-{}",
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let res = (|| -> std::io::Result<()> {
        let f = File::create(&tmp)?;
        {
            let mut w = std::io::BufWriter::with_capacity(1 << 20, &f);
            fill(&mut w)?;
            w.flush()?;
        }
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        // Make the rename durable; some filesystems refuse fsync on a
        // directory handle, which is not worth failing the write for.
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if let Err(e) = res {
        let _ = fs::remove_file(&tmp);
        return Err(Error::io(format!("writing {}", path.display()), e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_atomic_replaces_the_file_and_leaves_no_temporary() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.bin");
        write_atomic(&p, |w| w.write_all(b"one")).unwrap();
        write_atomic(&p, |w| w.write_all(b"two")).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 1);
    }
}
