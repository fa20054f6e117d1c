//! Crash-safe checkpoint directories.
//!
//! A checkpoint is a directory of files plus `manifest.json`, which records
//! every file's size and SHA-256 and is written last. It is assembled in a
//! hidden temporary directory next to its final place, every file and
//! directory is fsynced, and the temporary directory is renamed into place,
//! so a reader sees either no checkpoint or a complete one. Loading verifies
//! the manifest: a truncated, corrupted or missing file is an
//! [`ErrorKind::Corrupt`] error naming the file.
//!
//! [`CheckpointDir`] adds automatic naming (`checkpoint_0`, `checkpoint_1`,
//! ...) with `total_limit` pruning by number, never by string order
//! (`checkpoint_10` is newer than `checkpoint_9`), and finds the latest one
//! so a resumed run continues the numbering.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};

use accel_api::{Error, ErrorKind, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::swap::{partial_dir_for, recover_swap, replace_dir, sync_dir};

/// Name of the manifest inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// Size and checksum of one file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Length in bytes.
    pub size: u64,
    /// Lower-case hex SHA-256 of the contents.
    pub sha256: String,
}

/// The manifest: every file of the checkpoint (relative path with `/`
/// separators) with its size and checksum, and a checksum of its own list.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version, currently 1.
    pub version: u32,
    /// Files by relative path.
    pub files: BTreeMap<String, FileEntry>,
    /// Lower-case hex SHA-256 of the compact JSON of `files`, so an altered
    /// manifest is reported as itself rather than as the file whose entry
    /// changed. Absent in manifests written before it existed (then not
    /// checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

impl Manifest {
    /// The checksum [`digest`](Self::digest) should hold for `files`.
    pub fn compute_digest(&self) -> String {
        let bytes = serde_json::to_vec(&self.files).expect("manifest entries serialise");
        hex(&Sha256::digest(&bytes))
    }
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::io(format!("{what} {}", path.display()), e).with_op("checkpoint")
}

fn corrupt(msg: String) -> Error {
    Error::new(ErrorKind::Corrupt, msg).with_op("checkpoint")
}

/// Hash and measure a file.
fn hash_file(path: &Path) -> Result<FileEntry> {
    let f = File::open(path).map_err(|e| io_err("cannot open", path, e))?;
    hash_reader(f, path)
}

/// Hash and measure what `f` (read from `path`) yields.
fn hash_reader(mut f: impl Read, path: &Path) -> Result<FileEntry> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| io_err("cannot read", path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        size += n as u64;
    }
    Ok(FileEntry {
        size,
        sha256: hex(&h.finalize()),
    })
}

/// Lower-case hex SHA-256 of `bytes` (the checksum manifests record).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

impl FileEntry {
    /// The entry of a file holding `bytes`.
    pub fn of(bytes: &[u8]) -> FileEntry {
        FileEntry {
            size: bytes.len() as u64,
            sha256: sha256_hex(bytes),
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Check a checkpoint-relative file name: relative, no `..`, not the
/// manifest.
fn check_name(name: &str) -> Result<()> {
    let p = Path::new(name);
    let ok = !name.is_empty()
        && name != MANIFEST_FILE
        && p.components().all(|c| matches!(c, Component::Normal(_)));
    if ok {
        Ok(())
    } else {
        Err(Error::invalid_argument(
            "checkpoint",
            format!("{name:?} is not a valid file name inside a checkpoint (relative, no '..', not {MANIFEST_FILE})"),
        ))
    }
}

/// Write `bytes` to `path` and fsync it, creating parent directories.
///
/// # Errors
/// [`ErrorKind::Io`] naming the path.
pub fn write_file_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(|e| io_err("cannot create", parent, e))?;
    }
    let mut f = File::create(path).map_err(|e| io_err("cannot create", path, e))?;
    f.write_all(bytes)
        .map_err(|e| io_err("cannot write", path, e))?;
    f.sync_all().map_err(|e| io_err("cannot fsync", path, e))
}

/// Every regular file under `dir`, as `/`-separated relative names.
fn walk(dir: &Path, prefix: &str, out: &mut Vec<String>) -> Result<()> {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .map_err(|e| io_err("cannot list", dir, e))?
        .collect::<std::io::Result<_>>()
        .map_err(|e| io_err("cannot list", dir, e))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name().to_string_lossy().into_owned();
        let rel = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}/{name}")
        };
        let ty = e
            .file_type()
            .map_err(|err| io_err("cannot stat", &e.path(), err))?;
        if ty.is_dir() {
            walk(&e.path(), &rel, out)?;
        } else if ty.is_file() {
            out.push(rel);
        }
    }
    Ok(())
}

/// A checkpoint being assembled in a temporary directory.
///
/// # Behavior
/// The temporary directory is `.<name>.partial` next to the final
/// directory. Files go in with [`write`](Self::write) (or, from other ranks
/// on a shared file system, straight into [`temp_path`](Self::temp_path)
/// with [`write_file_synced`] before a barrier). [`commit`](Self::commit)
/// hashes every file found there, writes the manifest, fsyncs and renames.
/// A writer dropped without committing removes its temporary directory.
#[derive(Debug)]
pub struct CheckpointWriter {
    final_dir: PathBuf,
    temp_dir: PathBuf,
    done: bool,
    with_manifest: bool,
    recovered: Option<String>,
    /// Files [`check_files`](Self::check_files) found as reported: the
    /// seal takes their entries instead of hashing them again.
    checked: BTreeMap<String, FileEntry>,
}

impl CheckpointWriter {
    /// Start a checkpoint that will live at `final_dir`. A stale temporary
    /// directory from an interrupted save is removed first.
    ///
    /// # Errors
    /// [`ErrorKind::Io`] when the directories cannot be created.
    pub fn create(final_dir: impl AsRef<Path>) -> Result<CheckpointWriter> {
        let final_dir = final_dir.as_ref().to_path_buf();
        let temp_dir = temp_dir_for(&final_dir)?;
        // An interrupted swap's new folder is the stale-looking temporary
        // directory: finish that swap before clearing it.
        let recovered = recover_swap(&final_dir)?;
        if temp_dir.exists() {
            fs::remove_dir_all(&temp_dir)
                .map_err(|e| io_err("cannot remove stale", &temp_dir, e))?;
        }
        fs::create_dir_all(&temp_dir).map_err(|e| io_err("cannot create", &temp_dir, e))?;
        Ok(CheckpointWriter {
            final_dir,
            temp_dir,
            done: false,
            with_manifest: true,
            recovered,
            checked: BTreeMap::new(),
        })
    }

    /// The same writer, but [`commit`](Self::commit) writes no
    /// `manifest.json`: for directories in another program's layout (a
    /// Hugging Face model folder) that still need the atomic, fsynced
    /// rename. The returned [`Manifest`] still lists every file.
    pub fn without_manifest(mut self) -> CheckpointWriter {
        self.with_manifest = false;
        self
    }

    /// What [`create`](Self::create) did to finish a swap that a killed
    /// save had left half done at this path (see [`recover_swap`]), for
    /// the caller to log; `None` when there was nothing to finish.
    pub fn recovered(&self) -> Option<&str> {
        self.recovered.as_deref()
    }

    /// The temporary directory files are written to.
    pub fn temp_path(&self) -> &Path {
        &self.temp_dir
    }

    /// The directory the checkpoint will have after [`commit`](Self::commit).
    pub fn final_path(&self) -> &Path {
        &self.final_dir
    }

    /// Write one file (a relative name, `/` for sub-directories) and fsync
    /// it.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`]
    /// for an absolute name, `..` or the manifest's name;
    /// [`ErrorKind::Io`] naming the file.
    pub fn write(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        check_name(name)?;
        write_file_synced(&self.temp_dir.join(name), bytes)
    }

    /// Write `value` as pretty JSON under `name`.
    ///
    /// # Errors
    /// As [`write`](Self::write), and [`ErrorKind::InvalidArgument`]
    /// when `value` cannot be serialised.
    pub fn write_json<T: Serialize>(&mut self, name: &str, value: &T) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(value).map_err(|e| {
            Error::invalid_argument("checkpoint", format!("cannot serialise {name}: {e}"))
        })?;
        self.write(name, &bytes)
    }

    /// Check files that others (the other ranks) wrote into
    /// [`temp_path`](Self::temp_path) against what they say they wrote: each
    /// name with the size and SHA-256 of the bytes written. Returns every
    /// file that is not there as reported, with why (`missing`, its size, a
    /// different checksum, an invalid name), in name order; empty when all
    /// are. The files found as reported are not hashed again by the commit.
    ///
    /// A file missing here that its writer wrote and fsynced was written
    /// into another folder of the same path: the checkpoint folder is not
    /// one folder for every writer (a disk per machine).
    ///
    /// # Errors
    /// [`ErrorKind::Io`] when a file that is there cannot be read.
    pub fn check_files(
        &mut self,
        expected: &BTreeMap<String, FileEntry>,
    ) -> Result<Vec<(String, String)>> {
        let mut bad = Vec::new();
        for (name, want) in expected {
            if check_name(name).is_err() {
                bad.push((name.clone(), "not a valid file name".to_string()));
                continue;
            }
            let path = self.temp_dir.join(name);
            let got = match fs::symlink_metadata(&path) {
                Ok(m) if m.is_file() && m.len() == want.size => hash_file(&path)?,
                Ok(m) if m.is_file() => {
                    bad.push((
                        name.clone(),
                        format!("{} bytes, {} written", m.len(), want.size),
                    ));
                    continue;
                }
                Ok(_) => {
                    bad.push((name.clone(), "not a regular file".to_string()));
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    bad.push((name.clone(), "missing".to_string()));
                    continue;
                }
                Err(e) => return Err(io_err("cannot stat", &path, e)),
            };
            if got.sha256 == want.sha256 {
                self.checked.insert(name.clone(), got);
            } else {
                bad.push((name.clone(), "another SHA-256 than written".to_string()));
            }
        }
        Ok(bad)
    }

    fn seal(&mut self) -> Result<Manifest> {
        let mut names = Vec::new();
        walk(&self.temp_dir, "", &mut names)?;
        let mut manifest = Manifest {
            version: 1,
            files: BTreeMap::new(),
            digest: None,
        };
        for name in names.into_iter().filter(|n| n != MANIFEST_FILE) {
            let entry = match self.checked.remove(&name) {
                Some(e) => e,
                None => hash_file(&self.temp_dir.join(&name))?,
            };
            manifest.files.insert(name, entry);
        }
        if self.with_manifest {
            manifest.digest = Some(manifest.compute_digest());
            let bytes = serde_json::to_vec_pretty(&manifest).expect("manifest serialises");
            write_file_synced(&self.temp_dir.join(MANIFEST_FILE), &bytes)?;
        }
        // Sub-directories first, then the temporary root (with or without a
        // manifest: the folder is renamed into place next).
        let mut dirs = vec![self.temp_dir.clone()];
        for name in manifest.files.keys() {
            let mut p = self.temp_dir.join(name);
            while p.pop() && p != self.temp_dir {
                if !dirs.contains(&p) {
                    dirs.push(p.clone());
                }
            }
        }
        for d in dirs.iter().rev() {
            sync_dir(d)?;
        }
        Ok(manifest)
    }

    /// Seal the checkpoint and move it into place.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`]
    /// when the final directory already exists (use
    /// [`commit_replacing`](Self::commit_replacing)); [`ErrorKind::Io`]
    /// naming the path that failed.
    pub fn commit(mut self) -> Result<Manifest> {
        if self.final_dir.exists() {
            return Err(Error::invalid_argument(
                "checkpoint",
                format!("{} already exists", self.final_dir.display()),
            )
            .with_fix("save under another name, or replace it explicitly"));
        }
        let manifest = self.seal()?;
        replace_dir(&self.temp_dir, &self.final_dir)?;
        self.done = true;
        Ok(manifest)
    }

    /// Seal the checkpoint and move it into place, replacing an existing
    /// directory there, so that a process killed at any instant leaves the
    /// old checkpoint or the new one (one atomic exchange where the file
    /// system has it, else two renames that [`recover_swap`] completes: see
    /// [`swap`](crate::swap)).
    ///
    /// # Errors
    /// [`ErrorKind::Io`] naming the path that failed.
    pub fn commit_replacing(mut self) -> Result<Manifest> {
        let manifest = self.seal()?;
        replace_dir(&self.temp_dir, &self.final_dir)?;
        self.done = true;
        Ok(manifest)
    }
}

impl Drop for CheckpointWriter {
    fn drop(&mut self) {
        if !self.done {
            let _ = fs::remove_dir_all(&self.temp_dir);
        }
    }
}

/// The temporary directory a [`CheckpointWriter`] for `final_dir` uses, for
/// ranks that add files to a checkpoint the main rank is assembling (after
/// it called [`CheckpointWriter::create`] and before it commits, separated
/// by barriers).
///
/// # Errors
/// [`ErrorKind::InvalidArgument`]
/// when `final_dir` has no final component.
pub fn temp_path_for(final_dir: impl AsRef<Path>) -> Result<PathBuf> {
    temp_dir_for(final_dir.as_ref())
}

fn temp_dir_for(final_dir: &Path) -> Result<PathBuf> {
    partial_dir_for(final_dir)
}

/// Read and check the manifest of `dir` and every file it lists.
///
/// # Errors
/// [`ErrorKind::Corrupt`] when the manifest is missing or unreadable, or a
/// listed file is missing, has the wrong size (truncated) or the wrong
/// checksum; the message names the file.
pub fn verify_checkpoint(dir: impl AsRef<Path>) -> Result<Manifest> {
    let dir = dir.as_ref();
    let manifest = read_manifest(dir)?;
    for (name, entry) in &manifest.files {
        check_entry(dir, name, entry)?;
    }
    Ok(manifest)
}

/// Read the manifest of `dir` without checking the files.
///
/// # Errors
/// [`ErrorKind::Corrupt`] when it is missing or not a valid manifest.
pub fn read_manifest(dir: impl AsRef<Path>) -> Result<Manifest> {
    let dir = dir.as_ref();
    let path = dir.join(MANIFEST_FILE);
    let bytes = accel_api::files::read_regular(&path, "manifest").map_err(|e| {
        corrupt(format!(
            "{}: cannot read {MANIFEST_FILE} ({}); the checkpoint was not completely written",
            dir.display(),
            e.message()
        ))
    })?;
    let m: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| corrupt(format!("{} is not a valid manifest: {e}", path.display())))?;
    if m.version != 1 {
        return Err(corrupt(format!(
            "{}: unsupported manifest version {}",
            path.display(),
            m.version
        )));
    }
    if let Some(want) = &m.digest {
        let got = m.compute_digest();
        if &got != want {
            return Err(corrupt(format!(
                "{} is corrupted: its entries hash to {got}, the manifest says {want}",
                path.display()
            )));
        }
    }
    Ok(m)
}

/// Open a file the manifest lists: a regular file inside `dir` (the name
/// comes from a file) whose size is the manifest's; nothing is read yet.
fn open_listed(dir: &Path, name: &str, entry: &FileEntry) -> Result<(PathBuf, File)> {
    let (path, f) = accel_api::files::open_inside(dir, name, "checkpoint file").map_err(|e| {
        corrupt(format!(
            "{name} is listed in the manifest of {} but cannot be read: {}",
            dir.display(),
            e.message()
        ))
    })?;
    let len = f
        .metadata()
        .map_err(|e| io_err("cannot stat", &path, e))?
        .len();
    if len != entry.size {
        return Err(corrupt(format!(
            "{} is truncated or altered: {len} bytes, the manifest says {}",
            path.display(),
            entry.size
        )));
    }
    Ok((path, f))
}

fn check_entry(dir: &Path, name: &str, entry: &FileEntry) -> Result<()> {
    let (path, f) = open_listed(dir, name, entry)?;
    let got = hash_reader(f.take(entry.size), &path)
        .map_err(|e| corrupt(format!("{}: {e}", path.display())))?;
    if got.sha256 != entry.sha256 {
        return Err(corrupt(format!(
            "{} is corrupted: SHA-256 {} differs from the manifest's {}",
            path.display(),
            got.sha256,
            entry.sha256
        )));
    }
    Ok(())
}

/// Read one file of a checkpoint, checked against `manifest`.
///
/// # Errors
/// [`ErrorKind::Corrupt`] naming the file when it is not in the manifest,
/// missing, or its size or checksum differs.
pub fn read_verified(dir: impl AsRef<Path>, manifest: &Manifest, name: &str) -> Result<Vec<u8>> {
    let dir = dir.as_ref();
    let entry = manifest
        .files
        .get(name)
        .ok_or_else(|| corrupt(format!("{}: {name} is not in the manifest", dir.display())))?;
    let (path, f) = open_listed(dir, name, entry)?;
    let bytes =
        accel_api::files::read_at_most(f, entry.size, &path, "checkpoint file").map_err(|e| {
            corrupt(format!(
                "{} cannot be read: {}",
                path.display(),
                e.message()
            ))
        })?;
    if bytes.len() as u64 != entry.size {
        return Err(corrupt(format!(
            "{} is truncated or altered: {} bytes, the manifest says {}",
            path.display(),
            bytes.len(),
            entry.size
        )));
    }
    let sum = sha256_hex(&bytes);
    if sum != entry.sha256 {
        return Err(corrupt(format!(
            "{} is corrupted: SHA-256 {sum} differs from the manifest's {}",
            path.display(),
            entry.sha256
        )));
    }
    Ok(bytes)
}

/// Parse `checkpoint_<N>` (digits only) into `N`.
pub fn parse_checkpoint_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("checkpoint_")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A folder of automatically named checkpoints.
///
/// # Behavior
/// Checkpoints are the sub-directories named `checkpoint_<N>`; anything else
/// (temporary directories, other files) is ignored. Order is by `N` as a
/// number.
#[derive(Clone, Debug)]
pub struct CheckpointDir {
    root: PathBuf,
    total_limit: Option<usize>,
}

impl CheckpointDir {
    /// Checkpoints under `root`, keeping at most `total_limit` of them
    /// (`None`: keep all).
    pub fn new(root: impl Into<PathBuf>, total_limit: Option<usize>) -> CheckpointDir {
        CheckpointDir {
            root: root.into(),
            total_limit,
        }
    }

    /// The folder.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The path of checkpoint `n`.
    pub fn path_of(&self, n: u64) -> PathBuf {
        self.root.join(format!("checkpoint_{n}"))
    }

    /// The entries of the root folder (none when it is missing).
    fn entries(&self) -> Result<Vec<fs::DirEntry>> {
        let rd = match fs::read_dir(&self.root) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err("cannot list", &self.root, e)),
        };
        rd.map(|e| e.map_err(|err| io_err("cannot list", &self.root, err)))
            .collect()
    }

    /// All checkpoints, oldest (smallest number) first. A missing folder has
    /// none.
    ///
    /// # Errors
    /// [`ErrorKind::Io`] when the folder cannot be listed.
    pub fn list(&self) -> Result<Vec<(u64, PathBuf)>> {
        let mut out = Vec::new();
        for e in self.entries()? {
            let Some(n) = parse_checkpoint_name(&e.file_name().to_string_lossy()) else {
                continue;
            };
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                out.push((n, e.path()));
            }
        }
        out.sort_by_key(|(n, _)| *n);
        Ok(out)
    }

    /// The newest checkpoint, if any.
    ///
    /// # Errors
    /// As [`list`](Self::list).
    pub fn latest(&self) -> Result<Option<(u64, PathBuf)>> {
        Ok(self.list()?.pop())
    }

    /// The number the next save uses: one past the newest, 0 for none.
    ///
    /// # Errors
    /// As [`list`](Self::list).
    pub fn next_iteration(&self) -> Result<u64> {
        Ok(self.latest()?.map_or(0, |(n, _)| n + 1))
    }

    /// Start checkpoint `n`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`]
    /// when it already exists (the numbering was not restored), or as
    /// [`CheckpointWriter::create`].
    pub fn begin(&self, n: u64) -> Result<CheckpointWriter> {
        let path = self.path_of(n);
        if path.exists() {
            return Err(Error::invalid_argument(
                "checkpoint",
                format!("{} already exists", path.display()),
            )
            .with_fix(
                "continue the numbering with next_iteration() after loading the latest checkpoint",
            ));
        }
        CheckpointWriter::create(path)
    }

    /// Remove the oldest checkpoints until at most `total_limit` remain (a
    /// limit of 0 is taken as 1: the newest is always kept); returns the
    /// removed paths. Call it after a new checkpoint is
    /// committed, so the newest durable one is never the one removed.
    ///
    /// # Behavior
    /// Each checkpoint is first renamed to the hidden `.checkpoint_N.pruning`
    /// (and the folder fsynced), then deleted, so a process killed while
    /// deleting never leaves a half-deleted `checkpoint_N` that
    /// [`list`](Self::list) would show; leftovers of such a kill are deleted
    /// by the next prune.
    ///
    /// # Errors
    /// [`ErrorKind::Io`] naming the directory that could not be removed.
    pub fn prune(&self) -> Result<Vec<PathBuf>> {
        self.prune_with(|p| fs::remove_dir_all(p))
    }

    fn prune_with(&self, remove: impl Fn(&Path) -> std::io::Result<()>) -> Result<Vec<PathBuf>> {
        let Some(limit) = self.total_limit else {
            return Ok(Vec::new());
        };
        let all = self.list()?;
        let excess = all.len().saturating_sub(limit.max(1));
        let mut doomed = Vec::new();
        for (n, p) in all.into_iter().take(excess) {
            let hidden = self.root.join(format!(".checkpoint_{n}.pruning"));
            if hidden.exists() {
                remove(&hidden).map_err(|e| io_err("cannot remove", &hidden, e))?;
            }
            fs::rename(&p, &hidden).map_err(|e| io_err("cannot move aside", &p, e))?;
            doomed.push((p, hidden));
        }
        if !doomed.is_empty() {
            sync_dir(&self.root)?;
        }
        for leftover in self.pruning_leftovers()? {
            if !doomed.iter().any(|(_, h)| *h == leftover) {
                remove(&leftover).map_err(|e| io_err("cannot remove", &leftover, e))?;
            }
        }
        let mut removed = Vec::new();
        for (p, hidden) in doomed {
            remove(&hidden).map_err(|e| io_err("cannot remove", &hidden, e))?;
            removed.push(p);
        }
        Ok(removed)
    }

    /// Hidden `.checkpoint_N.pruning` directories left by a killed prune.
    fn pruning_leftovers(&self) -> Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        for e in self.entries()? {
            let name = e.file_name().to_string_lossy().into_owned();
            let inner = name
                .strip_prefix('.')
                .and_then(|n| n.strip_suffix(".pruning"));
            if inner.and_then(parse_checkpoint_name).is_some() {
                out.push(e.path());
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn make(root: &Path, n: u64) {
        let mut w = CheckpointWriter::create(root.join(format!("checkpoint_{n}"))).unwrap();
        w.write("a.bin", &[1, 2, 3]).unwrap();
        w.write("sub/b.bin", &[4, 5]).unwrap();
        w.commit().unwrap();
    }

    #[test]
    fn a_prune_killed_while_deleting_leaves_no_half_deleted_checkpoint_visible() {
        let tmp = tempfile::tempdir().unwrap();
        for n in 0..3 {
            make(tmp.path(), n);
        }
        let dir = CheckpointDir::new(tmp.path(), Some(1));
        // A "kill" after the first file of the directory is gone: remove one
        // file, then stop with an error as a dead process would.
        let killed = dir.prune_with(|p| {
            fs::remove_file(p.join("a.bin"))?;
            Err(std::io::Error::other("killed"))
        });
        assert!(killed.is_err());
        let visible: Vec<u64> = dir.list().unwrap().into_iter().map(|(n, _)| n).collect();
        for (n, p) in dir.list().unwrap() {
            verify_checkpoint(&p)
                .unwrap_or_else(|e| panic!("checkpoint_{n} is visible but broken: {e}"));
        }
        assert!(visible.contains(&2), "{visible:?}");
        // The next prune finishes the job and removes the leftovers.
        dir.prune().unwrap();
        let names: Vec<String> = fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["checkpoint_2".to_string()]);
    }

    #[test]
    fn an_altered_manifest_is_reported_as_itself() {
        let tmp = tempfile::tempdir().unwrap();
        make(tmp.path(), 0);
        let path = tmp.path().join("checkpoint_0").join(MANIFEST_FILE);
        let text = fs::read_to_string(&path).unwrap();
        let m: Manifest = serde_json::from_str(&text).unwrap();
        let sum = &m.files["a.bin"].sha256;
        let flipped = if sum.starts_with('0') { "1" } else { "0" };
        let altered = text.replacen(sum.as_str(), &format!("{flipped}{}", &sum[1..]), 1);
        assert_ne!(altered, text);
        fs::write(&path, altered).unwrap();
        let e = verify_checkpoint(tmp.path().join("checkpoint_0")).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(MANIFEST_FILE), "{msg}");
        assert!(!msg.contains("a.bin"), "{msg}");
    }
}
