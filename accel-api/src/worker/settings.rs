//! The settings a launcher hands every worker as plain protocol values: the
//! process model, the training loop's mixed precision and its ZeRO stage.
//! The training stack gives them meaning (`accel::train`, `accel::zero`);
//! here they are names that parse and print.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::keys;
use crate::{Error, ErrorKind, Result};

/// How the ranks of a machine are laid out in processes
/// (`ACCEL_PROCESS_MODEL`; docs/adr/0015-process-model.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessModel {
    /// One rank per process (torchrun's model; the default).
    #[default]
    Processes,
    /// One process per machine hosting its LOCAL_WORLD_SIZE ranks as
    /// threads; RANK and LOCAL_RANK are those of the process's first rank
    /// thread (the program's `accel::run` starts the threads).
    Threads,
}

impl ProcessModel {
    /// The variable's spelling: `processes` or `threads`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProcessModel::Processes => "processes",
            ProcessModel::Threads => "threads",
        }
    }

    /// Read `ACCEL_PROCESS_MODEL`'s value (`processes` or `threads`, any
    /// case; surrounding spaces ignored).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] naming the variable for any other value.
    pub fn parse(v: &str) -> Result<ProcessModel> {
        match v.trim().to_ascii_lowercase().as_str() {
            "processes" | "process" => Ok(ProcessModel::Processes),
            "threads" | "thread" => Ok(ProcessModel::Threads),
            _ => Err(
                Error::invalid_config(keys::ACCEL_PROCESS_MODEL, v, "not a process model")
                    .with_fix("set ACCEL_PROCESS_MODEL to `processes` or `threads`, or unset it"),
            ),
        }
    }
}

/// Mixed-precision mode (Accelerate's `mixed_precision`;
/// `ACCEL_MIXED_PRECISION`, `accel launch --mixed-precision`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MixedPrecision {
    /// Everything in the model's own precision.
    #[default]
    No,
    /// Forward under bf16 autocast (where the framework supports it); no
    /// loss scaling (bf16 has f32's range).
    Bf16,
    /// Forward under fp16 autocast; the loss is scaled by a dynamic loss
    /// scaler (`accel::train::GradScaler`) and steps with infinite or NaN
    /// gradients are skipped on every rank together.
    Fp16,
}

impl MixedPrecision {
    /// `no`, `bf16` or `fp16`.
    pub fn name(self) -> &'static str {
        match self {
            MixedPrecision::No => "no",
            MixedPrecision::Bf16 => "bf16",
            MixedPrecision::Fp16 => "fp16",
        }
    }

    /// The mode `accel launch --mixed-precision` asked for through
    /// `ACCEL_MIXED_PRECISION`; `No` when unset.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] naming the variable for another value.
    pub fn from_env() -> Result<MixedPrecision> {
        let key = keys::ACCEL_MIXED_PRECISION;
        match std::env::var(key) {
            Ok(v) if !v.trim().is_empty() => v.parse().map_err(|e: Error| {
                Error::invalid_config(key, &v, e.to_string())
                    .with_fix("set it to no, bf16 or fp16 (accel launch --mixed-precision)")
            }),
            _ => Ok(MixedPrecision::No),
        }
    }
}

impl fmt::Display for MixedPrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for MixedPrecision {
    type Err = Error;
    /// `no`, `bf16`, `fp16` (case-insensitive; `none`/`fp32` mean `no`,
    /// `f16`/`float16` mean `fp16`, `bfloat16` means `bf16`).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming the spelling.
    fn from_str(s: &str) -> Result<MixedPrecision> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "no" | "none" | "fp32" | "f32" => MixedPrecision::No,
            "bf16" | "bfloat16" => MixedPrecision::Bf16,
            "fp16" | "f16" | "float16" | "half" => MixedPrecision::Fp16,
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("unknown mixed precision `{other}`"),
                )
                .with_fix("use no, bf16 or fp16"))
            }
        })
    }
}

/// What each rank keeps of the training state: the ZeRO stage
/// (`ACCEL_SHARDING`, `accel launch --sharding`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// Everything replicated (DDP).
    #[default]
    None,
    /// ZeRO-1: optimizer state sharded.
    Optimizer,
    /// ZeRO-2: optimizer state and gradients sharded.
    Gradients,
    /// ZeRO-3: optimizer state, gradients and parameters sharded.
    Full,
}

impl Stage {
    /// The spelling [`FromStr`] reads back.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::None => "none",
            Stage::Optimizer => "optimizer",
            Stage::Gradients => "gradients",
            Stage::Full => "full",
        }
    }

    /// The stage `ACCEL_SHARDING` names; `None` when it is unset or empty.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] naming the variable for an unknown
    /// stage.
    pub fn from_env() -> Result<Option<Stage>> {
        Stage::from_env_value(std::env::var(keys::ACCEL_SHARDING).ok().as_deref())
    }

    /// A value of `ACCEL_SHARDING` (read from the process environment or
    /// from a worker's); `None` when absent or empty.
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_env_value(value: Option<&str>) -> Result<Option<Stage>> {
        match value {
            Some(v) if !v.trim().is_empty() => v.parse().map(Some).map_err(|e: Error| {
                Error::invalid_config(keys::ACCEL_SHARDING, v, e.message().to_string())
                    .with_fix("set it to none, optimizer, gradients or full")
            }),
            _ => Ok(None),
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Stage {
    type Err = Error;

    /// `none|optimizer|gradients|full`, also DeepSpeed's stage numbers
    /// (`0`-`3`, `zero1`-`zero3`) and FSDP's `NO_SHARD`, `SHARD_GRAD_OP`
    /// and `FULL_SHARD`, case-insensitive.
    fn from_str(s: &str) -> Result<Stage> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" | "no" | "0" | "zero0" | "no_shard" => Ok(Stage::None),
            "optimizer" | "1" | "zero1" => Ok(Stage::Optimizer),
            "gradients" | "2" | "zero2" | "shard_grad_op" => Ok(Stage::Gradients),
            "full" | "3" | "zero3" | "full_shard" => Ok(Stage::Full),
            other => Err(Error::new(
                ErrorKind::InvalidConfig,
                format!("unknown sharding stage {other:?}"),
            )
            .with_fix("use one of none, optimizer, gradients, full")),
        }
    }
}
