//! `save_state` / `load_state`: exact-resume checkpoints of everything the
//! training loop owns, on top of `accel-sharding`'s atomic checkpoint
//! directories.
//!
//! The layout is documented on [`Checkpointed`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use accel_api::{BufMut, DType, Error, ErrorKind, Half16, Result};
use accel_sharding::{
    parse_checkpoint_name, read_manifest, read_verified, verify_checkpoint, AccumulatorState,
    CheckpointDir, CheckpointWriter, FileEntry, Manifest, SamplerState, MANIFEST_FILE,
};
use safetensors::tensor::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use super::adapters::{
    Dataset, Optimizer, Parameters, Scheduler, SharedStateful, StateDict, Tensor,
};
use super::grads;
use super::prepare::{PreparedLoader, PreparedModel, PreparedOptimizer, PreparedScheduler};
use super::rng::Rng;
use crate::{Accelerator, CollectivesExt};

/// Name of the accelerator's own state file inside a checkpoint.
pub const CHECKPOINT_STATE_FILE: &str = "accelerator.json";

const GRAD_PREFIX: &str = "__grad__.";

/// An object [`Accelerator::save_state`] saves and
/// [`Accelerator::load_state`] restores: every prepared wrapper implements
/// it. Object-safe, so a heterogeneous list can be passed.
///
/// # Layout of `checkpoint_N/`
/// | file | written by | holds |
/// |---|---|---|
/// | `accelerator.json` | main | format version, iteration `N`, world size, accumulation counter, object keys |
/// | `model_0.safetensors` (+ `.json`) | main | parameters (and, when saved inside an accumulation group, the gradients so far) |
/// | `optimizer_0.safetensors` + `.json` | main | optimizer tensors (momentum) and values (lr, steps) |
/// | `scheduler_0.json` | main | schedule position |
/// | `loader_0/rank_R.json` | each rank | sampler position: epoch, batches consumed, seed |
/// | `random_states/rank_R.json` | each rank | the rank's [`Rng`](super::Rng) state |
/// | `custom_I.safetensors` / `.json` | main | objects from `register_for_checkpointing`, in registration order |
/// | `manifest.json` | main, last | size and SHA-256 of every file |
///
/// Tensors are `f32` safetensors, except a bf16 or f16 parameter, which is
/// stored in its own type ([`StateDict::stored_as`]); each parameter is in
/// the model's own shape when it gives [`Parameters::param_shape`], else
/// 1-D; everything else is JSON. Loading checks a parameter's shape against the model's (a 1-D
/// tensor of the right length, as older checkpoints hold, passes). The directory is assembled as `.checkpoint_N.partial`, every file
/// fsynced, then renamed; ranks other than the main one write their files
/// into the same temporary directory, so checkpoints need a file system all
/// ranks share (as Accelerate's do): the main process commits only when it
/// finds every rank's files as the rank wrote them (size and SHA-256), and
/// otherwise the save fails on every rank naming the ranks whose files are
/// missing (docs/adr/0029-saves-complete-or-fail.md).
pub trait Checkpointed {
    /// The key naming its files (`model_0`, `optimizer_0`, `loader_0`, ...).
    fn checkpoint_key(&self) -> String;

    /// `true` when every rank saves its own state (loaders: each rank has
    /// its own position); `false` when the main process saves the one
    /// replicated state (model, optimizer, scheduler).
    fn per_rank(&self) -> bool {
        false
    }

    /// The state to save.
    ///
    /// # Errors
    /// The object's own.
    fn checkpoint_state(&self) -> Result<StateDict>;

    /// Restore a saved state.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] or [`ErrorKind::InvalidConfig`] when the state
    /// does not fit the object.
    fn restore_checkpoint_state(&mut self, state: StateDict) -> Result<()>;

    /// For a [`per_rank`](Self::per_rank) object: check the states every
    /// rank is about to load (element `r` from rank `r`) against each other,
    /// on every rank, before any is applied. The default accepts anything.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] naming the ranks whose states cannot belong
    /// to one moment of one run.
    fn check_rank_states(&self, states: &[StateDict]) -> Result<()> {
        let _ = states;
        Ok(())
    }

    /// For a [`per_rank`](Self::per_rank) object: the state rank `rank` of
    /// a run of `world` ranks loads from a checkpoint saved by
    /// `saved.len()` ranks (element `r` from rank `r`), when the world
    /// size changed (an elastic restart). The default refuses: the object's
    /// state belongs to the world size it was saved with.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] naming the object and both world sizes
    /// (the default); the object's own when the states do not fit.
    fn reshard_state(&self, saved: &[StateDict], rank: usize, world: usize) -> Result<StateDict> {
        let _ = rank;
        Err(Error::invalid_config(
            "WORLD_SIZE",
            &world.to_string(),
            format!(
                "{} was saved by {} processes and cannot be resharded to another world size",
                self.checkpoint_key(),
                saved.len()
            ),
        )
        .with_fix("resume at the saved world size, or load only the model, optimizer and scheduler with load_weights"))
    }
}

impl<M: Parameters> Checkpointed for PreparedModel<M> {
    fn checkpoint_key(&self) -> String {
        self.key.clone()
    }
    fn checkpoint_state(&self) -> Result<StateDict> {
        let mid_group = self.shared.lock().accumulator.state().step != 0;
        let mut s = StateDict::default();
        let k = self.model.grad_kernels();
        let k = k.as_deref();
        let mut err = None;
        self.model.visit_params(&mut |p| {
            if err.is_some() {
                return;
            }
            let r = (|| {
                // The model's own shape where it gives one (and it fits).
                let shape = self
                    .model
                    .param_shape(p.name)
                    .filter(|s| s.iter().product::<usize>() == p.value.len())
                    .unwrap_or_else(|| vec![p.value.len()]);
                let value = grads::read_f32(k, p.name, p.value)?;
                // A half-precision parameter is written in its own type.
                if matches!(p.value.dtype(), DType::BF16 | DType::F16) {
                    s.stored_as.insert(p.name.to_string(), p.value.dtype());
                }
                s.tensors.insert(
                    p.name.to_string(),
                    Tensor {
                        shape: shape.clone(),
                        data: value,
                    },
                );
                if mid_group {
                    let grad = grads::read_f32(k, p.name, p.grad)?;
                    let shape = if grad.len() == p.value.len() {
                        shape
                    } else {
                        vec![grad.len()]
                    };
                    s.tensors.insert(
                        format!("{GRAD_PREFIX}{}", p.name),
                        Tensor { shape, data: grad },
                    );
                }
                Ok(())
            })();
            if let Err(e) = r {
                err = Some(e);
            }
        });
        err.map_or(Ok(s), Err)
    }
    fn restore_checkpoint_state(&mut self, state: StateDict) -> Result<()> {
        let k = self.model.grad_kernels();
        let k = k.as_deref();
        let mut shapes = std::collections::BTreeMap::new();
        let mut retyped = None;
        self.model.visit_params(&mut |p| {
            if let Some(s) = self.model.param_shape(p.name) {
                shapes.insert(p.name.to_string(), s);
            }
            if retyped.is_none() && state.tensors.contains_key(p.name) {
                retyped = other_type(p.name, &state, p.value.dtype());
            }
        });
        if let Some(e) = retyped {
            return Err(e);
        }
        let mut err = None;
        self.model.visit_params_mut(&mut |p| {
            if err.is_some() {
                return;
            }
            let name = p.name;
            let model_shape = shapes.get(name);
            let fill = |dst: BufMut<'_>, t: &Tensor, what: &str| {
                // A 1-D tensor (older checkpoints, models without shapes)
                // fits any shape of its length.
                if let Some(want) = model_shape.filter(|_| t.shape.len() > 1) {
                    if &t.shape != want {
                        return Err(Error::new(
                            ErrorKind::Corrupt,
                            format!(
                                "{what} {name:?} has shape {:?} in the checkpoint, the model's is {want:?}",
                                t.shape
                            ),
                        ));
                    }
                }
                if t.data.len() != dst.len() {
                    return Err(Error::new(
                        ErrorKind::Corrupt,
                        format!(
                            "{what} {name:?} has {} values in the checkpoint, the model has {}",
                            t.data.len(),
                            dst.len()
                        ),
                    ));
                }
                grads::write_f32(k, name, dst, &t.data)
            };
            let r = state
                .tensor(name)
                .and_then(|t| fill(p.value, t, "parameter"));
            let mut grad = p.grad;
            let r = r.and_then(
                |()| match state.tensors.get(&format!("{GRAD_PREFIX}{name}")) {
                    Some(t) => fill(grad, t, "gradient"),
                    None => {
                        let zeros = vec![0.0; grad.len()];
                        grads::write_f32(k, name, grad.reborrow(), &zeros)
                    }
                },
            );
            if let Err(e) = r {
                err = Some(e);
            }
        });
        err.map_or(Ok(()), Err)
    }
}

/// The error for parameter `name` of element type `want` when `state`
/// holds it in another type: a bf16 or f16 parameter is stored in its own
/// type, any other as f32 (so an f64 parameter loads its f32 values).
/// Refused as `load_model` refuses it: an exact resume needs the types it
/// was saved with.
fn other_type(name: &str, state: &StateDict, want: DType) -> Option<Error> {
    let got = state.stored_as.get(name).copied().unwrap_or(DType::F32);
    let saved_as = |t: DType| match t {
        DType::BF16 | DType::F16 => t,
        _ => DType::F32,
    };
    (saved_as(want) != got).then(|| {
        Error::new(
            ErrorKind::Corrupt,
            format!(
                "parameter {name:?} is stored as {got} in the checkpoint, the model's is {want}"
            ),
        )
        .with_fix(
            "prepare the model with the element types it was saved with (an exact resume needs \
             them); to change a model's type, save its weights with save_model and read them \
             with load_model_converting",
        )
    })
}

impl<O: Optimizer> Checkpointed for PreparedOptimizer<O> {
    fn checkpoint_key(&self) -> String {
        self.key.clone()
    }
    fn checkpoint_state(&self) -> Result<StateDict> {
        let mut s = self.optimizer.state_dict();
        s.put("accel.steps_taken", &self.steps);
        Ok(s)
    }
    fn restore_checkpoint_state(&mut self, mut state: StateDict) -> Result<()> {
        self.steps = state.get("accel.steps_taken")?;
        state.values.remove("accel.steps_taken");
        self.optimizer.load_state_dict(&state)
    }
}

impl<S: Scheduler> Checkpointed for PreparedScheduler<S> {
    fn checkpoint_key(&self) -> String {
        self.key.clone()
    }
    fn checkpoint_state(&self) -> Result<StateDict> {
        Ok(self.scheduler.state_dict())
    }
    fn restore_checkpoint_state(&mut self, state: StateDict) -> Result<()> {
        self.scheduler.load_state_dict(&state)?;
        self.note_restored_rate();
        Ok(())
    }
}

impl<D: Dataset> Checkpointed for PreparedLoader<D> {
    fn checkpoint_key(&self) -> String {
        self.key.clone()
    }
    fn per_rank(&self) -> bool {
        true
    }
    fn checkpoint_state(&self) -> Result<StateDict> {
        let mut s = StateDict::default();
        s.put("sampler", &self.sampler_state());
        Ok(s)
    }
    fn restore_checkpoint_state(&mut self, state: StateDict) -> Result<()> {
        let st: SamplerState = state.get("sampler")?;
        self.load_sampler_state(&st)
    }
    fn check_rank_states(&self, states: &[StateDict]) -> Result<()> {
        let all = states
            .iter()
            .map(|s| s.get::<SamplerState>("sampler"))
            .collect::<Result<Vec<_>>>()?;
        accel_sharding::check_rank_states(&all)
    }
    /// Rank 0's position as samples consumed in its epoch, continued over
    /// the new world's ranks (ADR 0026): every rank gets the same state.
    fn reshard_state(&self, saved: &[StateDict], _rank: usize, world: usize) -> Result<StateDict> {
        let first = saved.first().ok_or_else(|| {
            Error::new(ErrorKind::Corrupt, "the checkpoint holds no loader state")
        })?;
        let st: SamplerState = first.get("sampler")?;
        let mut s = StateDict::default();
        s.put("sampler", &st.resharded(world));
        Ok(s)
    }
}

/// `accelerator.json`.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Meta {
    pub(super) version: u32,
    pub(super) iteration: Option<u64>,
    pub(super) world_size: usize,
    pub(super) accumulator: AccumulatorState,
    pub(super) objects: Vec<String>,
    pub(super) custom_objects: usize,
    /// The fp16 loss scaler (absent outside fp16 and in older checkpoints).
    #[serde(default)]
    pub(super) scaler: Option<super::amp::GradScaler>,
}

/// The tensors of `s` as a safetensors file of `f32`, those named in
/// `s.stored_as` in that type.
/// A state's tensor as safetensors writes it: f32 values borrowed as their
/// little-endian bytes (no copy), or narrowed to f16/bf16 one tensor at a
/// time while the file is encoded.
struct StateView<'a> {
    dtype: Dtype,
    t: &'a Tensor,
}

impl safetensors::View for StateView<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.t.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        use std::borrow::Cow;
        let d = &self.t.data;
        match self.dtype {
            Dtype::F32 if cfg!(target_endian = "little") => Cow::Borrowed(bytemuck::cast_slice(d)),
            dtype => Cow::Owned(super::safetensors_file::encode_values(d, dtype)),
        }
    }
    fn data_len(&self) -> usize {
        self.t.data.len() * self.dtype.bitsize() / 8
    }
}

/// `s`'s tensors as one safetensors file, in their stored element types.
fn encode_tensors(s: &StateDict) -> Result<Vec<u8>> {
    let mut views = Vec::with_capacity(s.tensors.len());
    for (name, t) in &s.tensors {
        let dtype = match s.stored_as.get(name) {
            Some(DType::BF16) => Dtype::BF16,
            Some(DType::F16) => Dtype::F16,
            _ => Dtype::F32,
        };
        let n: usize = t.shape.iter().product();
        if n != t.data.len() {
            return Err(Error::invalid_argument(
                "save_state",
                format!(
                    "tensor {name:?}: shape {:?} does not fit its {} values",
                    t.shape,
                    t.data.len()
                ),
            ));
        }
        views.push((name.as_str(), StateView { dtype, t }));
    }
    safetensors::serialize(views, None).map_err(|e| {
        Error::invalid_argument("save_state", format!("cannot encode safetensors: {e}"))
    })
}

/// The tensors of a decoded file stored in a half type.
fn half_types(bytes: &[u8]) -> std::collections::BTreeMap<String, DType> {
    let Ok((_, meta)) = SafeTensors::read_metadata(bytes) else {
        return Default::default(); // decoding reports it
    };
    meta.tensors()
        .into_iter()
        .filter_map(|(n, i)| match i.dtype {
            Dtype::BF16 => Some((n, DType::BF16)),
            Dtype::F16 => Some((n, DType::F16)),
            _ => None,
        })
        .collect()
}

/// Decode a safetensors file into `f32` tensors (`f16`, `bf16` and `f64`
/// are converted).
pub(crate) fn decode_tensors(
    bytes: &[u8],
    path: &Path,
) -> Result<std::collections::BTreeMap<String, Tensor>> {
    let bad = |m: String| {
        Error::new(ErrorKind::Corrupt, format!("{}: {m}", path.display())).with_op("load_state")
    };
    let st = SafeTensors::deserialize(bytes).map_err(|e| bad(format!("not safetensors: {e}")))?;
    let mut out = std::collections::BTreeMap::new();
    for (name, view) in st.tensors() {
        let raw = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F64 => raw
                .chunks_exact(8)
                .map(|c| {
                    f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32
                })
                .collect(),
            Dtype::F16 => Half16::F16.widen(raw).collect(),
            Dtype::BF16 => Half16::BF16.widen(raw).collect(),
            other => {
                return Err(bad(format!(
                    "tensor {name:?} is {other:?}; accel loads F32, F64, F16 and BF16"
                )))
            }
        };
        out.insert(
            name,
            Tensor {
                shape: view.shape().to_vec(),
                data,
            },
        );
    }
    Ok(out)
}

pub(super) fn to_json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec_pretty(v).expect("checkpoint values serialise")
}

/// The files of one state under `stem` (`model_0`, `loader_0/rank_1`).
pub(super) fn encode_state(stem: &str, s: &StateDict) -> Result<Vec<(String, Vec<u8>)>> {
    let mut files = vec![(format!("{stem}.json"), to_json(&s.values))];
    if !s.tensors.is_empty() {
        files.push((format!("{stem}.safetensors"), encode_tensors(s)?));
    }
    Ok(files)
}

fn decode_state(dir: &Path, manifest: &Manifest, stem: &str) -> Result<StateDict> {
    let json = format!("{stem}.json");
    if !manifest.files.contains_key(&json) {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!(
                "{} has no state for {stem} ({json} is not in its manifest)",
                dir.display()
            ),
        )
        .with_op("load_state")
        .with_fix("pass the same prepared objects, in the same prepare order, as when saving"));
    }
    let bytes = read_verified(dir, manifest, &json)?;
    let values = serde_json::from_slice(&bytes).map_err(|e| {
        Error::new(
            ErrorKind::Corrupt,
            format!("{} is not valid JSON: {e}", dir.join(&json).display()),
        )
        .with_op("load_state")
    })?;
    let st = format!("{stem}.safetensors");
    let (tensors, stored_as) = if manifest.files.contains_key(&st) {
        let bytes = read_verified(dir, manifest, &st)?;
        (decode_tensors(&bytes, &dir.join(&st))?, half_types(&bytes))
    } else {
        Default::default()
    };
    Ok(StateDict {
        tensors,
        values,
        stored_as,
    })
}

/// Finish a folder swap that a killed save left half done at `dir`
/// (see [`accel_sharding::swap`]), logging what was done.
pub(crate) fn recover_logged(op: &str, dir: &Path) -> Result<()> {
    if let Some(what) = accel_sharding::recover_swap(dir)? {
        crate::notice::warn(Some(0), &format!("{op}: {what}"));
    }
    Ok(())
}

/// Check that every rank's files are in the main process's temporary
/// folder as the rank wrote them: `None` when they are, else the error
/// naming the ranks whose files are not, and those ranks. `reported[r]`:
/// rank `r`'s machine and its files' entries.
pub(super) fn incomplete_ranks(
    w: &mut CheckpointWriter,
    reported: &[(usize, BTreeMap<String, FileEntry>)],
    path: &Path,
) -> Result<Option<(Error, Vec<usize>)>> {
    /// Rank, machine, the files not there as written (name, why).
    type Missing = (usize, usize, Vec<(String, String)>);
    let mut bad: Vec<Missing> = Vec::new();
    for (r, (machine, files)) in reported.iter().enumerate() {
        let missing = w.check_files(files)?;
        if !missing.is_empty() {
            bad.push((r, *machine, missing));
        }
    }
    if bad.is_empty() {
        return Ok(None);
    }
    let ranks: Vec<usize> = bad.iter().map(|(r, _, _)| *r).collect();
    let named: Vec<String> = bad
        .iter()
        .take(8)
        .map(|(r, m, _)| format!("{r} (machine {m})"))
        .collect();
    let more = if bad.len() > 8 {
        format!(" and {} more", bad.len() - 8)
    } else {
        String::new()
    };
    let (first, _, files) = &bad[0];
    let shown: Vec<String> = files
        .iter()
        .take(3)
        .map(|(n, why)| format!("{n}: {why}"))
        .collect();
    let e = Error::new(
        ErrorKind::InvalidConfig,
        format!(
            "{} is not saved: the files of rank{} {}{more} are not in {}, where rank 0 \
             assembles it (rank {first}: {}); the likely cause: the checkpoint folder is not \
             one folder that every rank sees (a disk of each machine's own, or another path \
             on some ranks), and a checkpoint needs every rank's files; the previous \
             checkpoint stays the newest",
            path.display(),
            if bad.len() > 1 { "s" } else { "" },
            named.join(", "),
            w.temp_path().display(),
            shown.join(", ")
        ),
    )
    .with_op("save_state")
    .with_fix(
        "save into a folder on a file system every machine mounts at the same path (NFS, a \
         cluster file system), and give every rank the same path",
    );
    Ok(Some((e, ranks)))
}

/// `e`, an object's own error, prefixed with the object's files in `dir`;
/// kind and fix kept.
fn in_object(dir: &Path, key: &str, e: Error) -> Error {
    let m = format!("{}: {}", dir.join(key).display(), e.message());
    let out = Error::new(e.kind().clone(), m);
    match e.fix() {
        Some(f) => out.with_fix(f),
        None => out,
    }
}

pub(super) fn kind_from_name(name: &str) -> ErrorKind {
    match name {
        "corrupt" => ErrorKind::Corrupt,
        "invalid_argument" => ErrorKind::InvalidArgument,
        "invalid_config" => ErrorKind::InvalidConfig,
        "unsupported" => ErrorKind::Unsupported,
        _ => ErrorKind::Io,
    }
}

/// Every rank of `comm` learns whether any rank failed; the failing rank
/// keeps its own error, the others get one naming it. Collective on `comm`.
pub(super) fn agree_on<T>(
    comm: &dyn accel_api::Communicator,
    rank: usize,
    op: &str,
    local: Result<T>,
) -> Result<T> {
    let local = local.map_err(|e| e.with_op(op).with_rank(rank));
    if comm.world_size() == 1 {
        return local;
    }
    let mine: Option<(String, String)> = local
        .as_ref()
        .err()
        .map(|e| (e.kind().name().to_string(), e.to_string()));
    let all = comm.gather_object(&mine)?;
    let v = local?;
    match all
        .iter()
        .enumerate()
        .find_map(|(r, x)| x.as_ref().map(|x| (r, x)))
    {
        Some((r, (kind, msg))) => Err(Error::new(
            kind_from_name(kind),
            format!("rank {r} failed: {msg}"),
        )
        .with_op(op)
        .with_rank(rank)),
        None => Ok(v),
    }
}

impl Accelerator {
    /// Every rank learns whether any rank failed; the failing rank keeps its
    /// own error, the others get one naming it. Collective.
    pub(crate) fn agree<T>(&self, op: &str, local: Result<T>) -> Result<T> {
        agree_on(&**self.comm(), self.rank(), op, local)
    }

    /// Register an object whose state every [`save_state`](Self::save_state)
    /// saves (from the main process) and every
    /// [`load_state`](Self::load_state) restores, keyed `custom_I` in
    /// registration order (Accelerate's `register_for_checkpointing`).
    /// Keep a clone of the `Arc` to use the object.
    pub fn register_for_checkpointing(&self, object: SharedStateful) {
        super::shared(self).lock().registered.push(object);
    }

    /// The number the next automatically named checkpoint gets.
    pub fn save_iteration(&self) -> u64 {
        super::shared(self).lock().iteration
    }

    /// Set the number the next automatically named checkpoint gets
    /// (Accelerate's `save_iteration` override). [`load_state`](Self::load_state)
    /// sets it for you.
    pub fn set_save_iteration(&self, n: u64) {
        super::shared(self).lock().iteration = n;
    }

    /// Save the training state as `root/checkpoint_N` (`N` counts saves and
    /// continues after [`load_state`](Self::load_state)), then prune the
    /// oldest beyond [`TrainConfig::total_limit`](super::TrainConfig::total_limit),
    /// by number. Returns the new directory. Collective. With
    /// [`TrainConfig::async_save`](super::TrainConfig::async_save) it saves
    /// in the background, as [`save_state_async`](Self::save_state_async).
    ///
    /// # Behavior
    /// Saves every object in `objects` (prepared wrappers or anything
    /// [`Checkpointed`]), the registered objects, the accumulation counter,
    /// each rank's loader position and RNG state. See the
    /// [layout](Checkpointed) of the files. Nothing is visible under `root` until the
    /// checkpoint is complete; a failure on any rank fails the call on every
    /// rank and leaves no partial `checkpoint_N`. Before committing, the
    /// main process checks that every rank's files are in its temporary
    /// folder with the sizes and checksums the ranks wrote (ADR 0029).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when `root` already holds a
    /// checkpoint numbered `N` or higher (a fresh run saving into the folder
    /// of an old one: load it first, or use another folder; Accelerate
    /// fails only on an exact collision, and otherwise lets pruning delete
    /// the new checkpoint); [`ErrorKind::InvalidConfig`] naming the ranks
    /// (and machines) whose files are not in the main process's folder as
    /// written: `root` is not one folder every rank sees (the previous
    /// checkpoint stays the newest); [`ErrorKind::Io`] naming the path; the
    /// communicator's.
    pub fn save_state(
        &self,
        root: impl AsRef<Path>,
        objects: &[&dyn Checkpointed],
    ) -> Result<PathBuf> {
        self.wait_for_save()?;
        let background = super::shared(self).lock().config.async_save;
        self.save_numbered(root.as_ref(), objects, background)
    }

    /// Save the training state into exactly `dir`, replacing a checkpoint
    /// already there (the old one is removed only once the new one is in
    /// place). Does not use or advance the automatic numbering. Collective.
    ///
    /// # Errors
    /// As [`save_state`](Self::save_state).
    pub fn save_state_to(
        &self,
        dir: impl AsRef<Path>,
        objects: &[&dyn Checkpointed],
    ) -> Result<PathBuf> {
        self.wait_for_save()?;
        let _section = self.watch().section(crate::watch::Section::Checkpoint);
        let _phase = self.phase_guard(crate::watch::Phase::Checkpoint);
        self.save_into(dir.as_ref(), objects)
    }

    /// The newest `checkpoint_N` under `root`, if any.
    ///
    /// # Errors
    /// [`ErrorKind::Io`] when `root` cannot be listed.
    pub fn latest_checkpoint(&self, root: impl AsRef<Path>) -> Result<Option<PathBuf>> {
        Ok(CheckpointDir::new(root.as_ref(), None)
            .latest()?
            .map(|(_, p)| p))
    }

    /// Restore the training state saved by [`save_state`](Self::save_state)
    /// into `objects` (the same kinds prepared in the same order), the
    /// registered objects, the accumulation counter, each rank's loader
    /// position and RNG. `path` is a checkpoint directory, or a folder of
    /// `checkpoint_N` directories (the newest is loaded). Returns the
    /// directory loaded. Collective.
    ///
    /// # Behavior
    /// Every file is checked against the manifest first, and the loader
    /// positions of all ranks are checked against each other (one
    /// checkpoint holds one moment of one run). After loading
    /// `checkpoint_N`, the next [`save_state`](Self::save_state) writes
    /// `checkpoint_{N+1}`. Loaders continue with exactly the batches that
    /// had not been read, in the same order and epoch. The newest
    /// checkpoint is taken as is: when it is damaged the call fails
    /// (use [`load_latest_intact`](Self::load_latest_intact) to fall back to
    /// an older one).
    ///
    /// A checkpoint saved at another world size (an elastic restart, ADR
    /// 0026) is resharded: map-style loaders continue at the first sample
    /// of the epoch's order not read yet (no sample of the epoch skipped or
    /// read twice; the last step of the epoch is topped up or dropped as at
    /// any world size), rank `r` continues rank `r`'s RNG stream (a new
    /// rank a stream derived from rank `r mod` the saved world size's), and
    /// other per-rank objects through [`Checkpointed::reshard_state`].
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when there is no checkpoint at `path`;
    /// [`ErrorKind::Corrupt`] naming the file when one is missing, truncated
    /// or altered (the manifest included), has no state for one of
    /// `objects`, holds a parameter in another shape or element type than
    /// the model's (a bf16 parameter saved, an f32 one now: refused, as
    /// [`load_model`](Self::load_model) refuses it), or when the ranks'
    /// loader positions disagree;
    /// [`ErrorKind::InvalidConfig`] when it was saved with another data
    /// layout, or with another world size by a per-rank object that cannot
    /// be resharded (iterable loaders, objects of your own without
    /// [`Checkpointed::reshard_state`]: use [`load_weights`](Self::load_weights)). A failure on any rank fails
    /// every rank.
    pub fn load_state(
        &self,
        path: impl AsRef<Path>,
        objects: &mut [&mut dyn Checkpointed],
    ) -> Result<PathBuf> {
        // A background save in flight commits first.
        self.wait_for_save()?;
        self.load_impl(path.as_ref(), objects, false, true)
    }

    /// [`load_state`](Self::load_state) from a folder of checkpoints,
    /// falling back from a damaged newest checkpoint to the newest intact
    /// one. Collective.
    ///
    /// # Behavior
    /// The main process verifies `checkpoint_N` from the highest number
    /// down and loads the first whose manifest and files all check out;
    /// each one skipped is logged as a warning with the reason (nothing is
    /// deleted: the damaged ones stay for inspection, and `total_limit`
    /// prunes them in time). The numbering continues after the highest
    /// number present, so the next save never collides with a damaged
    /// checkpoint. With a checkpoint directory as `path` this is
    /// `load_state`.
    ///
    /// # Errors
    /// As [`load_state`](Self::load_state); [`ErrorKind::Corrupt`] listing
    /// every checkpoint and why when none is intact.
    pub fn load_latest_intact(
        &self,
        root: impl AsRef<Path>,
        objects: &mut [&mut dyn Checkpointed],
    ) -> Result<PathBuf> {
        self.load_impl(root.as_ref(), objects, true, true)
    }

    /// Load only the replicated weights of a checkpoint written by
    /// [`save_state`](Self::save_state), at **any** world size: the model,
    /// optimizer (momentum and other tensors, step counts) and scheduler
    /// states in `objects`, and the registered objects. Loader positions,
    /// RNG states and the accumulation counter are not loaded (they are
    /// per world size); start the loaders fresh. The checkpoint numbering
    /// continues after the one loaded. Collective.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming a per-rank object (a loader)
    /// passed in `objects`; otherwise as [`load_state`](Self::load_state).
    pub fn load_weights(
        &self,
        path: impl AsRef<Path>,
        objects: &mut [&mut dyn Checkpointed],
    ) -> Result<PathBuf> {
        self.load_impl(path.as_ref(), objects, false, false)
    }

    /// Pick the checkpoint to load on the main process: `(dir, already
    /// verified, highest number under the folder)`.
    fn pick_checkpoint(&self, path: &Path, fallback: bool) -> Result<(PathBuf, bool, Option<u64>)> {
        const OP: &str = "load_state";
        recover_logged(OP, path)?;
        if path.join(MANIFEST_FILE).exists() {
            return Ok((path.to_path_buf(), false, None));
        }
        let all = CheckpointDir::new(path, None).list()?;
        let highest = all.last().map(|(n, _)| *n);
        if all.is_empty() {
            return Err(Error::invalid_argument(
                OP,
                format!(
                    "no checkpoint in {} (no manifest.json, no checkpoint_N)",
                    path.display()
                ),
            ));
        }
        if !fallback {
            let (_, p) = all.last().expect("not empty").clone();
            return Ok((p, false, highest));
        }
        let mut skipped: Vec<(PathBuf, Error)> = Vec::new();
        for (_, p) in all.iter().rev() {
            match verify_checkpoint(p) {
                Ok(_) => {
                    for (q, e) in &skipped {
                        crate::notice::warn(
                            Some(self.rank()),
                            &format!(
                                "load_latest_intact: skipped the damaged checkpoint {} ({e}); loading {}",
                                q.display(),
                                p.display()
                            ),
                        );
                    }
                    return Ok((p.clone(), true, highest));
                }
                Err(e) => skipped.push((p.clone(), e)),
            }
        }
        let why: Vec<String> = skipped
            .iter()
            .map(|(p, e)| format!("{}: {}", p.display(), e.message()))
            .collect();
        Err(Error::new(
            ErrorKind::Corrupt,
            format!(
                "no intact checkpoint in {}: {}",
                path.display(),
                why.join("; ")
            ),
        ))
    }

    fn load_impl(
        &self,
        path: &Path,
        objects: &mut [&mut dyn Checkpointed],
        fallback: bool,
        full: bool,
    ) -> Result<PathBuf> {
        let op = if full { "load_state" } else { "load_weights" };
        let picked = if self.is_main_process() {
            self.pick_checkpoint(path, fallback).map(Some)
        } else {
            Ok(None)
        };
        let picked = self.agree(op, picked)?;
        let (dir, verified, highest): (String, bool, Option<u64>) = self.comm().broadcast_object(
            picked
                .map(|(p, v, h)| (p.to_string_lossy().into_owned(), v, h))
                .as_ref(),
            0,
        )?;
        let dir = PathBuf::from(dir);
        // The main process checks every file; the others check what they read.
        let manifest = if self.is_main_process() && !verified {
            verify_checkpoint(&dir)
        } else if !dir.exists() {
            Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "{} (rank 0's checkpoint) does not exist on this rank's machine: the \
                     checkpoint folder is not one folder that every rank sees (ADR 0029)",
                    dir.display()
                ),
            )
            .with_fix(
                "keep checkpoints in a folder on a file system every machine mounts at the \
                 same path (NFS, a cluster file system)",
            ))
        } else {
            read_manifest(&dir)
        };
        let manifest = manifest.map_err(|e| {
            if e.kind() == &ErrorKind::Corrupt && !fallback {
                e.with_fix("restore the file, or resume from the newest intact checkpoint with load_latest_intact")
            } else {
                e
            }
        });
        let manifest = self.agree(op, manifest)?;
        let rank = self.rank();
        let world = self.world_size();
        let registered = super::shared(self).lock().registered.clone();

        // 1. Read and decode everything, changing nothing yet.
        type Loaded = (Meta, Vec<StateDict>, Vec<StateDict>, Option<Rng>);
        let loaded = (|| -> Result<Loaded> {
            let bytes = read_verified(&dir, &manifest, CHECKPOINT_STATE_FILE)?;
            let meta: Meta = serde_json::from_slice(&bytes).map_err(|e| {
                Error::new(
                    ErrorKind::Corrupt,
                    format!(
                        "{} is not valid: {e}",
                        dir.join(CHECKPOINT_STATE_FILE).display()
                    ),
                )
            })?;
            // Another world size (an elastic restart): per-rank states are
            // resharded from every saved rank's (ADR 0026).
            let resharding = full && meta.world_size != world;
            let mut states = Vec::with_capacity(objects.len());
            for o in objects.iter() {
                let key = o.checkpoint_key();
                let stem = if !o.per_rank() {
                    key
                } else if resharding {
                    let saved = (0..meta.world_size)
                        .map(|r| decode_state(&dir, &manifest, &format!("{key}/rank_{r}")))
                        .collect::<Result<Vec<_>>>()?;
                    states.push(
                        o.reshard_state(&saved, rank, world)
                            .map_err(|e| in_object(&dir, &key, e))?,
                    );
                    continue;
                } else if full {
                    format!("{key}/rank_{rank}")
                } else {
                    return Err(Error::invalid_argument(
                        "load_weights",
                        format!(
                            "{key} is saved per rank (a loader position): it belongs to the world size it was saved with ({} processes; this run has {world})",
                            meta.world_size
                        ),
                    )
                    .with_fix("pass only the model, optimizer and scheduler to load_weights, or use load_state at the saved world size"));
                };
                states.push(decode_state(&dir, &manifest, &stem)?);
            }
            if registered.len() > meta.custom_objects {
                return Err(Error::new(
                    ErrorKind::Corrupt,
                    format!(
                        "{} holds {} registered objects, {} are registered now",
                        dir.display(),
                        meta.custom_objects,
                        registered.len()
                    ),
                ));
            }
            let custom = (0..registered.len())
                .map(|i| decode_state(&dir, &manifest, &format!("custom_{i}")))
                .collect::<Result<Vec<_>>>()?;
            let rng = if full {
                // A rank the saved run did not have continues from a
                // stream derived from an existing rank's.
                let from = rank % meta.world_size.max(1);
                let name = format!("random_states/rank_{from}.json");
                let bytes = read_verified(&dir, &manifest, &name)?;
                let saved: Rng = serde_json::from_slice(&bytes).map_err(|e| {
                    Error::new(
                        ErrorKind::Corrupt,
                        format!("{} is not valid: {e}", dir.join(&name).display()),
                    )
                })?;
                Some(if from == rank {
                    saved
                } else {
                    saved.derived(rank as u64)
                })
            } else {
                None
            };
            Ok((meta, states, custom, rng))
        })();
        let (meta, states, custom, rng) = self.agree(op, loaded)?;

        // 2. Per-rank states must describe one moment of one run.
        if full && world > 1 && objects.iter().any(|o| o.per_rank()) {
            let mine: Vec<std::collections::BTreeMap<String, serde_json::Value>> = objects
                .iter()
                .zip(&states)
                .filter(|(o, _)| o.per_rank())
                .map(|(_, s)| s.values.clone())
                .collect();
            let all: Vec<Vec<std::collections::BTreeMap<String, serde_json::Value>>> =
                self.comm().gather_object(&mine)?;
            let checked = (|| -> Result<()> {
                for (i, o) in objects.iter().filter(|o| o.per_rank()).enumerate() {
                    let per_rank: Vec<StateDict> = all
                        .iter()
                        .map(|r| StateDict {
                            values: r[i].clone(),
                            ..Default::default()
                        })
                        .collect();
                    o.check_rank_states(&per_rank)
                        .map_err(|e| in_object(&dir, &o.checkpoint_key(), e))?;
                }
                Ok(())
            })();
            self.agree(op, checked)?;
        }

        // 3. Apply.
        let applied = (|| -> Result<()> {
            for (o, state) in objects.iter_mut().zip(states) {
                let key = o.checkpoint_key();
                o.restore_checkpoint_state(state)
                    .map_err(|e| in_object(&dir, &key, e))?;
            }
            for (r, s) in registered.iter().zip(custom) {
                r.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .load_state_dict(s)?;
            }
            Ok(())
        })();
        self.agree(op, applied)?;
        if let Some(rng) = rng {
            super::shared(self).replace_rng(rng);
        }
        let mut st = super::shared(self).lock();
        if full {
            st.accumulator.load_state(meta.accumulator);
            st.decision = None;
        }
        if let (Some(saved), Some(scaler)) = (meta.scaler, st.amp.scaler.as_mut()) {
            // The saved scale and tracker; the settings stay this run's.
            scaler.scale = saved.scale;
            scaler.growth_tracker = saved.growth_tracker;
        }
        st.amp.unscaled = None;
        let numbered = dir
            .file_name()
            .and_then(|n| parse_checkpoint_name(&n.to_string_lossy()));
        if let Some(n) = numbered.or(meta.iteration).max(highest) {
            st.iteration = n + 1;
        }
        Ok(dir)
    }
}
