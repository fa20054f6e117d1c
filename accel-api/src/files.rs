//! Opening files whose names come from other files (indexes, manifests,
//! plugin directories), shared by every crate that reads them.
//!
//! A name read from a file is accepted only when it stays inside the folder
//! that file belongs to: relative, without `..`, and, after following
//! symlinks, still inside. Only regular files are opened: opening a FIFO
//! blocks until a writer appears, and a device such as `/dev/zero` never
//! ends. [`read_regular`] reads no more than the size the file had when it
//! was opened.

use std::fs::{self, File};
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use crate::{Error, ErrorKind, Result};

fn file_kind(t: &fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_block_device() || t.is_char_device() {
            return "a device";
        }
    }
    if t.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// Check that `path` is a regular file (after following symlinks) without
/// opening it. `what` names the file's role in the error (`checkpoint
/// shard`, `plugin`, ...).
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] for a FIFO, socket, device or directory;
/// [`ErrorKind::Io`] when it cannot be inspected (missing included).
pub fn check_regular(path: &Path, what: &str) -> Result<fs::Metadata> {
    let meta =
        fs::metadata(path).map_err(|e| Error::io(format!("{what} {}", path.display()), e))?;
    if !meta.is_file() {
        let kind = file_kind(&meta.file_type());
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("{what} {} is {kind}, not a regular file", path.display()),
        )
        .with_fix("point at the real file (accel reads only regular files)"));
    }
    Ok(meta)
}

/// Open `path` for reading, refusing anything but a regular file (after
/// following symlinks); see [`check_regular`].
///
/// # Errors
/// As [`check_regular`]; [`ErrorKind::Io`] when it cannot be opened.
pub fn open_regular(path: &Path, what: &str) -> Result<File> {
    check_regular(path, what)?;
    let f =
        File::open(path).map_err(|e| Error::io(format!("open {what} {}", path.display()), e))?;
    // The name may have been replaced between the check and the open.
    match f.metadata() {
        Ok(m) if m.is_file() => Ok(f),
        _ => Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("{what} {} is not a regular file", path.display()),
        )),
    }
}

/// [`open_regular`] and read the whole file, never more than the size it
/// had when opened.
///
/// # Errors
/// As [`open_regular`]; [`ErrorKind::Io`] when the read fails.
pub fn read_regular(path: &Path, what: &str) -> Result<Vec<u8>> {
    let f = open_regular(path, what)?;
    let len = f.metadata().map_or(0, |m| m.len());
    read_at_most(f, len, path, what)
}

/// Read `f` to its end, refusing a file longer than `max` bytes.
///
/// # Errors
/// [`ErrorKind::Corrupt`] naming `path` when it holds more than `max`
/// bytes; [`ErrorKind::Io`] when the read fails.
pub fn read_at_most(f: File, max: u64, path: &Path, what: &str) -> Result<Vec<u8>> {
    let mut v = Vec::with_capacity(usize::try_from(max).unwrap_or(0));
    f.take(max.saturating_add(1))
        .read_to_end(&mut v)
        .map_err(|e| Error::io(format!("read {what} {}", path.display()), e))?;
    if v.len() as u64 > max {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!(
                "{what} {} holds more than the {max} bytes it should",
                path.display()
            ),
        ));
    }
    Ok(v)
}

/// The path of `name`, a name read from a file that belongs to `dir`,
/// refused unless it stays inside `dir`: a relative path of plain
/// components (no `..`, no root), whose target, symlinks followed, is
/// inside `dir`'s own target. The file must exist and be regular.
/// Returns `dir.join(name)`.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] naming the file (and `dir`) when the
/// name leaves the folder or the file is not regular; [`ErrorKind::Io`]
/// when it is missing or cannot be inspected.
pub fn resolve_inside(dir: &Path, name: &str, what: &str) -> Result<PathBuf> {
    let path = dir.join(name);
    let plain = !name.is_empty()
        && Path::new(name)
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    let outside = |how: &str| {
        Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "{what} {name:?} ({}) {how} the folder {} it belongs to",
                path.display(),
                dir.display()
            ),
        )
        .with_fix("name files by their plain names inside the folder (no '..', no absolute path, no symlink out of it)")
    };
    if !plain {
        return Err(outside("is not a plain name inside"));
    }
    check_regular(&path, what)?;
    let real =
        fs::canonicalize(&path).map_err(|e| Error::io(format!("{what} {}", path.display()), e))?;
    let root =
        fs::canonicalize(dir).map_err(|e| Error::io(format!("folder {}", dir.display()), e))?;
    if !real.starts_with(&root) {
        return Err(outside(&format!("resolves to {}, outside", real.display())));
    }
    Ok(path)
}

/// [`resolve_inside`], then [`open_regular`].
///
/// # Errors
/// As those two.
pub fn open_inside(dir: &Path, name: &str, what: &str) -> Result<(PathBuf, File)> {
    let path = resolve_inside(dir, name, what)?;
    let f = open_regular(&path, what)?;
    Ok((path, f))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_leave_the_folder_are_refused() {
        let base = std::env::temp_dir().join(format!("accel-files-{}", std::process::id()));
        let dir = base.join("d");
        fs::create_dir_all(dir.join("sub")).unwrap();
        fs::write(dir.join("sub/a"), b"x").unwrap();
        fs::write(base.join("outside"), b"y").unwrap();
        assert!(resolve_inside(&dir, "sub/a", "t").is_ok());
        for bad in [
            "../outside",
            "/etc/passwd",
            "",
            "sub/../../outside",
            "./sub/a",
        ] {
            let e = resolve_inside(&dir, bad, "t").unwrap_err();
            assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{bad}: {e}");
        }
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(base.join("outside"), dir.join("out")).unwrap();
            std::os::unix::fs::symlink(dir.join("sub/a"), dir.join("in")).unwrap();
            let e = resolve_inside(&dir, "out", "t").unwrap_err();
            assert!(e.to_string().contains("outside"), "{e}");
            assert!(resolve_inside(&dir, "in", "t").is_ok());
        }
        assert_eq!(read_regular(&dir.join("sub/a"), "t").unwrap(), b"x");
        fs::remove_dir_all(&base).unwrap();
    }
}
