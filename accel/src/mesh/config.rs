//! `ParallelismConfig`: Accelerate's sizes (`dp_replicate`, `dp_shard`,
//! `tp`, `cp`), read from what `accelerate launch` exports and checked up
//! front, the same way on every rank, with one sentence per rule.

use accel_api::{Error, ErrorKind, Result};

/// The variables `accelerate launch` exports for its `ParallelismConfig`.
pub const DP_REPLICATE_SIZE_ENV: &str = "PARALLELISM_CONFIG_DP_REPLICATE_SIZE";
/// See [`DP_REPLICATE_SIZE_ENV`].
pub const DP_SHARD_SIZE_ENV: &str = "PARALLELISM_CONFIG_DP_SHARD_SIZE";
/// See [`DP_REPLICATE_SIZE_ENV`].
pub const TP_SIZE_ENV: &str = "PARALLELISM_CONFIG_TP_SIZE";
/// See [`DP_REPLICATE_SIZE_ENV`].
pub const CP_SIZE_ENV: &str = "PARALLELISM_CONFIG_CP_SIZE";
/// DeepSpeed's sequence parallelism in Accelerate; accel refuses it.
pub const SP_SIZE_ENV: &str = "PARALLELISM_CONFIG_SP_SIZE";
/// Accelerate's context-parallel backend (`torch` only).
pub const CP_BACKEND_ENV: &str = "PARALLELISM_CONFIG_CP_BACKEND";

/// How the world is divided: data parallel replicated (`dp_replicate`) ×
/// data parallel sharded (`dp_shard`) × context parallel (`cp`) × tensor
/// parallel (`tp`), Accelerate's `ParallelismConfig`. HSDP is
/// `dp_replicate > 1` and `dp_shard > 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelismConfig {
    /// Replicas of the model (DDP across them).
    pub dp_replicate: usize,
    /// Ranks one replica is sharded over (ZeRO / FSDP within them).
    pub dp_shard: usize,
    /// Tensor-parallel ranks of one layer.
    pub tp: usize,
    /// Context-parallel ranks (refused by [`for_world`](Self::for_world) for
    /// now).
    pub cp: usize,
}

impl Default for ParallelismConfig {
    fn default() -> ParallelismConfig {
        ParallelismConfig {
            dp_replicate: 1,
            dp_shard: 1,
            tp: 1,
            cp: 1,
        }
    }
}

fn invalid(what: String, fix: &str) -> Error {
    Error::new(ErrorKind::InvalidArgument, what)
        .with_op("parallelism config")
        .with_fix(fix.to_string())
}

impl ParallelismConfig {
    /// The sizes `accelerate launch` exports (`PARALLELISM_CONFIG_*`), each
    /// 1 when unset; `None` when none is set.
    ///
    /// # Errors
    /// `InvalidArgument` naming the variable: a size that is not a whole
    /// number; `PARALLELISM_CONFIG_SP_SIZE` above 1 or a context-parallel
    /// backend other than `torch` (as Accelerate refuses it).
    pub fn from_env() -> Result<Option<ParallelismConfig>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// [`from_env`](Self::from_env) over `get` (a variable's value).
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<ParallelismConfig>> {
        let size = |k: &str| -> Result<Option<usize>> {
            match get(k) {
                None => Ok(None),
                Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
                    invalid(
                        format!("{k}={v:?} is not a size"),
                        "give a whole number of ranks, 1 or more (1: the dimension is off)",
                    )
                }),
            }
        };
        if let Some(sp) = size(SP_SIZE_ENV)? {
            if sp > 1 {
                return Err(invalid(
                    format!(
                        "{SP_SIZE_ENV}={sp}: sequence parallelism is DeepSpeed's in Accelerate"
                    ),
                    "accel does not drive DeepSpeed; unset it (or set 1)",
                ));
            }
        }
        if let Some(b) = get(CP_BACKEND_ENV) {
            if b.trim() != "torch" {
                return Err(invalid(
                    format!("{CP_BACKEND_ENV}={b:?}: the context-parallel backend must be torch"),
                    "unset it or set torch, as Accelerate requires",
                ));
            }
        }
        let sizes = [
            size(DP_REPLICATE_SIZE_ENV)?,
            size(DP_SHARD_SIZE_ENV)?,
            size(TP_SIZE_ENV)?,
            size(CP_SIZE_ENV)?,
        ];
        if sizes.iter().all(Option::is_none) {
            return Ok(None);
        }
        let [dp_replicate, dp_shard, tp, cp] = sizes.map(|s| s.unwrap_or(1));
        Ok(Some(ParallelismConfig {
            dp_replicate,
            dp_shard,
            tp,
            cp,
        }))
    }

    /// The product of the sizes.
    pub fn total(&self) -> usize {
        self.dp_replicate * self.dp_shard * self.tp * self.cp
    }

    /// Ranks that see different batches: `dp_replicate × dp_shard`.
    pub fn data_parallel_size(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }

    /// World rank `rank`'s index among the data-parallel ranks, and their
    /// number: the mesh is row-major over `dp_replicate, dp_shard, cp, tp`,
    /// so the ranks of one context- and tensor-parallel block (which see
    /// the same batches) share an index.
    pub fn data_parallel_place(&self, rank: usize) -> (usize, usize) {
        (
            rank / (self.cp.max(1) * self.tp.max(1)),
            self.data_parallel_size(),
        )
    }

    /// This configuration for `world_size` ranks: checked, and, when every
    /// size is 1, the whole world as `dp_replicate` (plain data parallel,
    /// as Accelerate does).
    ///
    /// # Errors
    /// `InvalidArgument`, one sentence per rule, naming the sizes and the
    /// fix: a size of 0; `cp > 1` (not supported yet: it needs a hook into
    /// each framework's attention); `tp` with `dp_replicate > 1` but
    /// `dp_shard == 1` (Accelerate's rule: TP composes with FSDP or HSDP,
    /// not with pure replication); a product other than `world_size`.
    pub fn for_world(&self, world_size: usize) -> Result<ParallelismConfig> {
        for (name, v) in [
            ("dp_replicate_size", self.dp_replicate),
            ("dp_shard_size", self.dp_shard),
            ("tp_size", self.tp),
            ("cp_size", self.cp),
        ] {
            if v == 0 {
                return Err(invalid(
                    format!("{name} is 0"),
                    "every size is at least 1 (1: the dimension is off)",
                ));
            }
        }
        if self.cp > 1 {
            return Err(invalid(
                format!(
                    "cp_size={} (context parallelism) is not supported yet",
                    self.cp
                ),
                "set cp_size=1: context parallelism needs a hook into each framework's \
                 attention, which accel does not have yet",
            ));
        }
        if self.tp > 1 && self.dp_replicate > 1 && self.dp_shard == 1 {
            return Err(invalid(
                format!(
                    "tp_size={} with dp_replicate_size={} and dp_shard_size=1: tensor \
                     parallelism does not compose with pure replication",
                    self.tp, self.dp_replicate
                ),
                "use dp_shard_size > 1 with dp_replicate_size=1 (FSDP + TP), or both above 1 \
                 (HSDP + TP), as Accelerate requires",
            ));
        }
        if self.total() == 1 {
            return Ok(ParallelismConfig {
                dp_replicate: world_size,
                ..*self
            });
        }
        if self.total() != world_size {
            return Err(invalid(
                format!(
                    "dp_replicate_size {} x dp_shard_size {} x tp_size {} x cp_size {} = {} \
                     ranks, but the run has {world_size}",
                    self.dp_replicate,
                    self.dp_shard,
                    self.tp,
                    self.cp,
                    self.total()
                ),
                "make the sizes multiply to the world size (accel launch -n, times machines)",
            ));
        }
        Ok(*self)
    }

    /// The mesh's dimensions, Accelerate's order (`dp_replicate`,
    /// `dp_shard`, `cp`, `tp`), those above 1 only; `[("dp_replicate", 1)]`
    /// for one rank.
    pub fn dims(&self) -> Vec<(&'static str, usize)> {
        let all = [
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("cp", self.cp),
            ("tp", self.tp),
        ];
        let on: Vec<_> = all.into_iter().filter(|(_, n)| *n > 1).collect();
        if on.is_empty() {
            vec![("dp_replicate", 1)]
        } else {
            on
        }
    }
}
