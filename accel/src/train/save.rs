//! Writing a checkpoint in two halves: the state staged in memory on the
//! calling thread ([`Accelerator::stage_checkpoint`]: the writer agreed,
//! a snapshot of every object's state), then encoded, written, checked and
//! committed ([`commit_staged`]: files fsynced into the temporary folder, every
//! rank's files checked by the main process, the rename, the pruning) on
//! that thread (`save_state`) or on a thread of its own over a
//! communicator of its own (`save_state_async`, ADR 0036).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use accel_api::{Communicator, Error, Op, Result};
use accel_sharding::{
    temp_path_for, write_file_synced, CheckpointDir, CheckpointWriter, FileEntry,
};

use super::checkpoint::{
    agree_on, encode_state, incomplete_ranks, to_json, Meta, CHECKPOINT_STATE_FILE,
};
use super::shared::PendingSave;
use crate::train::{Checkpointed, StateDict};
use crate::{Accelerator, CollectivesExt};

const OP: &str = "save_state";

/// A checkpoint staged in memory, ready to be written.
pub(super) struct Staged {
    path: PathBuf,
    replace: bool,
    /// The main process's writer of the temporary folder.
    writer: Option<CheckpointWriter>,
    temp: PathBuf,
    files: Vec<StagedFile>,
    rank: usize,
    node_rank: usize,
    /// The main process of a numbered save: prune the oldest afterwards.
    prune: Option<CheckpointDir>,
}

/// One file of a staged checkpoint, or the files of one state: a state is
/// encoded (safetensors and JSON) when it is written, so that a background
/// save's caller waits only for the snapshot.
pub(super) enum StagedFile {
    Bytes(String, Vec<u8>),
    State(String, StateDict),
}

impl StagedFile {
    /// The state `s` under `stem`, its tensors' shapes checked now (what
    /// encoding would refuse later).
    fn state(stem: String, s: StateDict) -> Result<StagedFile> {
        for (name, t) in &s.tensors {
            if t.shape.iter().product::<usize>() != t.data.len() {
                return Err(Error::invalid_argument(
                    OP,
                    format!(
                        "{stem}: tensor {name:?}: shape {:?} does not fit its {} values",
                        t.shape,
                        t.data.len()
                    ),
                ));
            }
        }
        Ok(StagedFile::State(stem, s))
    }
}

/// Write `s`'s files, check every rank's from the main process, commit,
/// prune: every rank of `comm` (the ranks that staged it) together.
///
/// # Errors
/// As `save_state`: I/O naming the path, the ranks whose files the main
/// process does not see, the communicator's; the same on every rank.
pub(super) fn commit_staged(comm: &dyn Communicator, s: Staged) -> Result<PathBuf> {
    let Staged {
        path,
        replace,
        writer,
        temp,
        files,
        rank,
        node_rank,
        prune,
    } = s;
    let main = writer.is_some();
    let written = (|| -> Result<BTreeMap<String, FileEntry>> {
        let mut entries = BTreeMap::new();
        for f in files {
            let encoded = match f {
                StagedFile::Bytes(name, bytes) => vec![(name, bytes)],
                StagedFile::State(stem, state) => encode_state(&stem, &state)?,
            };
            for (name, bytes) in encoded {
                write_file_synced(&temp.join(&name), &bytes)?;
                entries.insert(name, FileEntry::of(&bytes));
            }
        }
        Ok(entries)
    })();
    let written = agree_on(comm, rank, OP, written)?;
    // The main process commits only what holds every rank's files as
    // written (ADR 0029): not so, the save fails on every rank.
    let reported: Vec<(usize, BTreeMap<String, FileEntry>)> = if comm.world_size() == 1 {
        vec![(node_rank, written)]
    } else {
        comm.gather_object(&(node_rank, written))?
    };
    let (committed, missing) = match writer {
        Some(mut w) => match incomplete_ranks(&mut w, &reported, &path) {
            Ok(None) if replace => (w.commit_replacing().map(|_| ()), Vec::new()),
            Ok(None) => (w.commit().map(|_| ()), Vec::new()),
            Ok(Some((e, ranks))) => (Err(e), ranks),
            Err(e) => (Err(e), Vec::new()),
        },
        None => (Ok(()), Vec::new()),
    };
    let missing: Vec<usize> = if comm.world_size() == 1 {
        missing
    } else {
        comm.broadcast_object(main.then_some(&missing), 0)?
    };
    if !main && missing.contains(&rank) {
        // This rank's files went into a folder of its own: leave no
        // `.partial` folder behind there.
        let _ = std::fs::remove_dir_all(&temp);
    }
    agree_on(comm, rank, OP, committed)?;
    let pruned = prune.map_or(Ok(()), |dir| dir.prune().map(|_| ()));
    agree_on(comm, rank, OP, pruned)?;
    Ok(path)
}

impl Accelerator {
    /// Stage a checkpoint of `objects` for `path`: the main process creates
    /// the temporary folder (refusing an existing `path` unless `replace`),
    /// every rank takes a snapshot of its states (encoded when written).
    /// `prune`: the numbered
    /// folder to prune after the commit. Collective.
    ///
    /// # Errors
    /// As `save_state`, the same on every rank.
    pub(super) fn stage_checkpoint(
        &self,
        path: &Path,
        replace: bool,
        iteration: Option<u64>,
        objects: &[&dyn Checkpointed],
        prune: Option<CheckpointDir>,
    ) -> Result<Staged> {
        let main = self.is_main_process();
        let rank = self.rank();
        let writer = if main {
            if !replace && path.exists() {
                Err(Error::invalid_argument(
                    OP,
                    format!("{} already exists", path.display()),
                )
                .with_fix("load the latest checkpoint first (the numbering continues after it), or save into another folder"))
            } else {
                CheckpointWriter::create(path).map(|w| {
                    if let Some(what) = w.recovered() {
                        crate::notice::warn(Some(rank), &format!("{OP}: {what}"));
                    }
                    Some(w)
                })
            }
        } else {
            Ok(None)
        };
        let writer = self.agree(OP, writer)?;
        let temp = temp_path_for(path)?;
        let (meta, registered) = {
            let st = super::shared(self).lock();
            let meta = Meta {
                version: 1,
                iteration,
                world_size: self.world_size(),
                accumulator: st.accumulator.state(),
                objects: objects.iter().map(|o| o.checkpoint_key()).collect(),
                custom_objects: st.registered.len(),
                scaler: st.amp.scaler,
            };
            (meta, st.registered.clone())
        };
        let rng = super::shared(self).rng_state(OP);
        let files = (|| -> Result<Vec<StagedFile>> {
            let rng = rng?;
            let mut files = Vec::new();
            for o in objects {
                let key = o.checkpoint_key();
                if o.per_rank() {
                    let stem = format!("{key}/rank_{rank}");
                    files.push(StagedFile::state(stem, o.checkpoint_state()?)?);
                } else if main {
                    files.push(StagedFile::state(key, o.checkpoint_state()?)?);
                }
            }
            if main {
                for (i, r) in registered.iter().enumerate() {
                    let s = r.lock().unwrap_or_else(|p| p.into_inner()).state_dict()?;
                    files.push(StagedFile::state(format!("custom_{i}"), s)?);
                }
                let meta = to_json(&meta);
                files.push(StagedFile::Bytes(CHECKPOINT_STATE_FILE.to_string(), meta));
            }
            let rng = to_json(&rng);
            files.push(StagedFile::Bytes(
                format!("random_states/rank_{rank}.json"),
                rng,
            ));
            Ok(files)
        })();
        let files = self.agree(OP, files)?;
        Ok(Staged {
            path: path.to_path_buf(),
            replace,
            writer,
            temp,
            files,
            rank,
            node_rank: self.state().node_rank,
            prune: if main { prune } else { None },
        })
    }

    /// `save_state_to`'s save into exactly `dir`, on the calling thread.
    pub(super) fn save_into(&self, dir: &Path, objects: &[&dyn Checkpointed]) -> Result<PathBuf> {
        let staged = self.stage_checkpoint(dir, true, None, objects, None)?;
        commit_staged(&**self.comm(), staged)
    }

    /// The numbered save of `save_state` (`background`: of
    /// `save_state_async`) under `root`.
    pub(super) fn save_numbered(
        &self,
        root: &Path,
        objects: &[&dyn Checkpointed],
        background: bool,
    ) -> Result<PathBuf> {
        // ACCEL_TIMEOUT_CHECKPOINT's section and the checkpoint phase.
        let _section = self.watch().section(crate::watch::Section::Checkpoint);
        let _phase = self.phase_guard(crate::watch::Phase::Checkpoint);
        let (n, limit) = {
            let st = super::shared(self).lock();
            (st.iteration, st.config.total_limit)
        };
        let dir = CheckpointDir::new(root, limit);
        // A number at or below the newest one would go backwards: the new
        // checkpoint would sort as the oldest and be pruned first.
        let fresh = if self.is_main_process() {
            match dir.latest() {
                Ok(Some((m, p))) if m >= n => Err(Error::invalid_argument(
                    OP,
                    format!(
                        "{} already holds {}; this run would save checkpoint_{n}",
                        root.display(),
                        p.display()
                    ),
                )
                .with_fix("load_state the latest checkpoint first (the numbering continues after it), call set_save_iteration, or save into another folder")),
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            }
        } else {
            Ok(())
        };
        self.agree(OP, fresh)?;
        let path = dir.path_of(n);
        let staged = self.stage_checkpoint(&path, false, Some(n), objects, Some(dir))?;
        let side = if background { self.save_comm()? } else { None };
        let Some(comm) = side else {
            let path = commit_staged(&**self.comm(), staged)?;
            super::shared(self).lock().iteration = n + 1;
            return Ok(path);
        };
        super::shared(self).lock().iteration = n + 1;
        let thread = std::thread::Builder::new()
            .name(format!("accel-save-{}", self.rank()))
            .spawn(move || commit_staged(&*comm, staged))
            .map_err(|e| Error::io("starting the background save", e).with_op(OP))?;
        super::shared(self).lock().pending_save = Some(PendingSave::new(path.clone(), thread));
        Ok(path)
    }

    /// The communicator background saves commit over (split off the
    /// world's once, on the first background save: collective then);
    /// `None` where the engine cannot split one (the save then commits on
    /// the calling thread, said once).
    fn save_comm(&self) -> Result<Option<Arc<dyn Communicator>>> {
        if let Some(c) = super::shared(self).lock().save_comm.clone() {
            return Ok(Some(c));
        }
        let comm: Arc<dyn Communicator> = if self.world_size() == 1 {
            self.comm().clone()
        } else if self.comm().capabilities().supports(Op::Split) {
            let me = u32::try_from(self.rank()).unwrap_or(u32::MAX);
            match self.comm().split(Some(0), me)? {
                Some(c) => Arc::from(c),
                None => return Ok(None),
            }
        } else {
            if self.is_main_process() {
                crate::notice::warn(
                    Some(self.rank()),
                    &format!(
                        "save_state_async: backend {} cannot split a communicator for the \
                         background commit; saves commit on the training thread",
                        self.comm().backend_name()
                    ),
                );
            }
            return Ok(None);
        };
        super::shared(self).lock().save_comm = Some(comm.clone());
        Ok(Some(comm))
    }

    /// Save the training state as [`save_state`](Self::save_state) does,
    /// but write it in the background: the state is copied to memory and
    /// the call returns `root/checkpoint_N` (not there yet); the files are
    /// written, checked and committed by a thread of each rank, over a
    /// communicator of their own (torch's `async_save`). The protocol is
    /// save_state's (temporary folder, fsync, checksums, the main process's
    /// check of every rank's files, rename), so the newest complete
    /// checkpoint is what loads even after a kill. A save still in flight
    /// is waited for first. Collective.
    ///
    /// A failed background write is reported by the next
    /// [`wait_for_save`](Self::wait_for_save) (which `save_state`,
    /// `save_state_async`, `load_state` and `end_training` call first), on
    /// every rank; a process that drops its accelerator with a save in
    /// flight waits for it and says if it failed.
    ///
    /// # Errors
    /// The previous background save's; as [`save_state`](Self::save_state)
    /// for what fails before the call returns.
    pub fn save_state_async(
        &self,
        root: impl AsRef<Path>,
        objects: &[&dyn Checkpointed],
    ) -> Result<PathBuf> {
        self.wait_for_save()?;
        self.save_numbered(root.as_ref(), objects, true)
    }

    /// Wait for the background save in flight, if any: the folder it
    /// committed (`None`: there was none). Collective when one was in
    /// flight (every rank has one then).
    ///
    /// # Errors
    /// The background save's, the same on every rank: I/O naming the path
    /// (a full disk), the ranks whose files the main process did not see,
    /// the communicator's. The checkpoint before it stays the newest.
    pub fn wait_for_save(&self) -> Result<Option<PathBuf>> {
        let pending = super::shared(self).lock().pending_save.take();
        let Some(p) = pending else {
            return Ok(None);
        };
        let done = p.join();
        self.agree("save_state_async", done).map(Some)
    }
}
