//! Replacing a whole folder so that a process killed at any instant leaves
//! the old folder or the new one, never neither and never a mix.
//!
//! The new folder is assembled and fsynced as `.<name>.partial` next to
//! `<name>`. Then:
//!
//! * **One step** where the file system has it (Linux `renameat2` with
//!   `RENAME_EXCHANGE`: ext4, xfs, btrfs, tmpfs, overlayfs ...): the two
//!   folders trade names atomically; `.<name>.partial` then holds the old
//!   one, which is removed.
//! * **Two renames** elsewhere (NFS, other systems): `<name>` is moved to
//!   `.<name>.old`, then `.<name>.partial` to `<name>`, then `.<name>.old` is
//!   removed. A kill between the two renames leaves no `<name>`;
//!   [`recover_swap`] finds that state (only this sequence makes it: the old
//!   folder is moved aside only once the new one is complete) and completes
//!   the swap. Savers call it before they start (through
//!   [`CheckpointWriter::create`](crate::CheckpointWriter::create)), loaders
//!   before they read.
//!
//! Leftovers of either path (`.<name>.partial` or `.<name>.old` next to a
//! complete `<name>`) are older or unfinished generations; the next save
//! removes them.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use accel_api::{Error, Result};

/// A point of a folder swap, passed to the hook that tests install with
/// [`set_swap_hook`] to stop a save exactly there (not part of the API).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwapStep {
    /// The new folder is complete and fsynced as `.<name>.partial`; nothing
    /// has moved.
    Sealed,
    /// One-step path: `<name>` holds the new folder, `.<name>.partial` the
    /// old one.
    Exchanged,
    /// Two-rename path: the old folder is `.<name>.old`; `<name>` does not
    /// exist.
    MovedAside,
    /// Two-rename path: `<name>` holds the new folder; the old one is still
    /// `.<name>.old`.
    MovedIn,
    /// The parent directory is fsynced; the old folder is about to be
    /// removed.
    Synced,
}

static HOOK: Mutex<Option<fn(SwapStep)>> = Mutex::new(None);
static ONE_STEP: AtomicBool = AtomicBool::new(true);

/// Tests only: call `hook` at every [`SwapStep`] of every swap in this
/// process (a test aborts the process there to stand for a kill).
#[doc(hidden)]
pub fn set_swap_hook(hook: Option<fn(SwapStep)>) {
    *HOOK.lock().unwrap_or_else(|p| p.into_inner()) = hook;
}

/// Tests only: `false` makes every swap take the two-rename path, as on a
/// file system without `RENAME_EXCHANGE`.
#[doc(hidden)]
pub fn set_one_step_swap(enabled: bool) {
    ONE_STEP.store(enabled, Ordering::SeqCst);
}

pub(crate) fn step(s: SwapStep) {
    let hook = *HOOK.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(h) = hook {
        h(s);
    }
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::io(format!("{what} {}", path.display()), e).with_op("checkpoint")
}

pub(crate) fn parent_of(p: &Path) -> &Path {
    match p.parent() {
        Some(q) if !q.as_os_str().is_empty() => q,
        _ => Path::new("."),
    }
}

fn sibling(final_dir: &Path, suffix: &str) -> Result<PathBuf> {
    let name = final_dir.file_name().ok_or_else(|| {
        Error::invalid_argument(
            "checkpoint",
            format!(
                "{} has no final component to name a folder",
                final_dir.display()
            ),
        )
    })?;
    Ok(parent_of(final_dir).join(format!(".{}.{suffix}", name.to_string_lossy())))
}

/// `.<name>.partial`: where the new folder is assembled.
pub(crate) fn partial_dir_for(final_dir: &Path) -> Result<PathBuf> {
    sibling(final_dir, "partial")
}

/// `.<name>.old`: where the two-rename path parks the old folder.
pub(crate) fn old_dir_for(final_dir: &Path) -> Result<PathBuf> {
    sibling(final_dir, "old")
}

/// `true` when something (even a dangling symlink) has this name.
fn present(p: &Path) -> bool {
    fs::symlink_metadata(p).is_ok()
}

/// fsync a directory so renames and new entries in it are durable.
pub(crate) fn sync_dir(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        File::open(path)
            .and_then(|d| d.sync_all())
            .map_err(|e| io_err("cannot fsync directory", path, e))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// Trade the names of `a` and `b` (both in `parent`) in one step.
/// `Ok(false)` when the file system or kernel cannot.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn exchange(parent: &Path, a: &Path, b: &Path) -> std::io::Result<bool> {
    use nix::errno::Errno;
    use nix::fcntl::{renameat2, RenameFlags};
    let dir = File::open(parent)?;
    let (Some(an), Some(bn)) = (a.file_name(), b.file_name()) else {
        return Ok(false);
    };
    match renameat2(&dir, an, &dir, bn, RenameFlags::RENAME_EXCHANGE) {
        Ok(()) => Ok(true),
        Err(Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP) => Ok(false),
        Err(e) => Err(std::io::Error::from(e)),
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn exchange(_parent: &Path, _a: &Path, _b: &Path) -> std::io::Result<bool> {
    Ok(false)
}

/// Move the complete, fsynced folder `partial` to `final_dir`, replacing a
/// folder there (see the [module docs](self)). On return `partial` no longer
/// exists and the old folder is removed.
///
/// # Errors
/// [`ErrorKind::Io`](accel_api::ErrorKind::Io) naming the path that failed.
pub(crate) fn replace_dir(partial: &Path, final_dir: &Path) -> Result<()> {
    let parent = parent_of(final_dir).to_path_buf();
    step(SwapStep::Sealed);
    if !present(final_dir) {
        fs::rename(partial, final_dir).map_err(|e| io_err("cannot rename into", final_dir, e))?;
        sync_dir(&parent)?;
        step(SwapStep::Synced);
        return remove_stale_old(final_dir);
    }
    if ONE_STEP.load(Ordering::SeqCst)
        && exchange(&parent, partial, final_dir)
            .map_err(|e| io_err("cannot swap in", final_dir, e))?
    {
        step(SwapStep::Exchanged);
        sync_dir(&parent)?;
        step(SwapStep::Synced);
        // `partial` now holds the old folder.
        fs::remove_dir_all(partial).map_err(|e| io_err("cannot remove", partial, e))?;
        return remove_stale_old(final_dir);
    }
    remove_stale_old(final_dir)?;
    let old = old_dir_for(final_dir)?;
    fs::rename(final_dir, &old).map_err(|e| io_err("cannot move aside", final_dir, e))?;
    step(SwapStep::MovedAside);
    if let Err(e) = fs::rename(partial, final_dir) {
        // Put the old folder back rather than leave none.
        let _ = fs::rename(&old, final_dir);
        return Err(io_err("cannot rename into", final_dir, e));
    }
    step(SwapStep::MovedIn);
    sync_dir(&parent)?;
    step(SwapStep::Synced);
    fs::remove_dir_all(&old).map_err(|e| io_err("cannot remove", &old, e))
}

/// Remove `.<name>.old` left by a two-rename swap killed after its second
/// rename (an older generation).
fn remove_stale_old(final_dir: &Path) -> Result<()> {
    let old = old_dir_for(final_dir)?;
    if present(&old) {
        fs::remove_dir_all(&old).map_err(|e| io_err("cannot remove", &old, e))?;
    }
    Ok(())
}

/// Finish a folder swap that a killed process left between its two renames
/// (no `<name>`, the old folder at `.<name>.old`): the new folder at
/// `.<name>.partial` is moved into place and the old one removed; without a
/// new folder, the old one is moved back. Returns what was done, for the
/// caller to log; `None` when there was nothing to do (including a
/// complete `<name>` with leftovers beside it, which the next save removes).
///
/// # Errors
/// [`ErrorKind::Io`](accel_api::ErrorKind::Io) naming the path that could
/// not be moved or removed; [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
/// when `final_dir` has no final component.
pub fn recover_swap(final_dir: impl AsRef<Path>) -> Result<Option<String>> {
    let final_dir = final_dir.as_ref();
    if present(final_dir) || final_dir.file_name().is_none() {
        return Ok(None);
    }
    let old = old_dir_for(final_dir)?;
    if !present(&old) {
        return Ok(None);
    }
    let partial = partial_dir_for(final_dir)?;
    let parent = parent_of(final_dir);
    if present(&partial) {
        // The old folder is moved aside only once the new one is sealed.
        fs::rename(&partial, final_dir)
            .map_err(|e| io_err("cannot complete the interrupted swap into", final_dir, e))?;
        sync_dir(parent)?;
        fs::remove_dir_all(&old).map_err(|e| io_err("cannot remove", &old, e))?;
        return Ok(Some(format!(
            "{} was missing: a save was killed between its two renames; completed it (moved the new folder {} into place, removed the old one {})",
            final_dir.display(),
            partial.display(),
            old.display()
        )));
    }
    fs::rename(&old, final_dir)
        .map_err(|e| io_err("cannot undo the interrupted swap into", final_dir, e))?;
    sync_dir(parent)?;
    Ok(Some(format!(
        "{} was missing: a save was interrupted with no new folder left; moved the old one back from {}",
        final_dir.display(),
        old.display()
    )))
}
