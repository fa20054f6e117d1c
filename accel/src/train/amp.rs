//! Mixed precision: the mode (`no`, `bf16`, `fp16`), torch's dynamic loss
//! scaler for fp16, and the per-step state (unscaled yet? overflow found?
//! step skipped?) the optimizer, the scheduler and clipping share.

use std::fmt;
use std::str::FromStr;

use accel_api::{Error, ErrorKind, Result};
use serde::{Deserialize, Serialize};

/// The environment variable `accel launch --mixed-precision` sets (as
/// Accelerate's `ACCELERATE_MIXED_PRECISION`).
pub const MIXED_PRECISION_ENV: &str = "ACCEL_MIXED_PRECISION";

/// Mixed-precision mode (Accelerate's `mixed_precision`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MixedPrecision {
    /// Everything in the model's own precision.
    #[default]
    No,
    /// Forward under bf16 autocast (where the framework supports it); no
    /// loss scaling (bf16 has f32's range).
    Bf16,
    /// Forward under fp16 autocast; the loss is scaled by a dynamic
    /// [`GradScaler`] and steps with infinite or NaN gradients are skipped
    /// on every rank together.
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
    /// [`MIXED_PRECISION_ENV`]; `No` when unset.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] naming the variable for another value.
    pub fn from_env() -> Result<MixedPrecision> {
        match std::env::var(MIXED_PRECISION_ENV) {
            Ok(v) if !v.trim().is_empty() => v.parse().map_err(|e: Error| {
                Error::invalid_config(MIXED_PRECISION_ENV, &v, e.to_string())
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

/// The dynamic loss scaler's settings, torch's `GradScaler` defaults.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GradScalerConfig {
    /// The first scale (default 2^16).
    pub init_scale: f64,
    /// Multiplies the scale after `growth_interval` steps without
    /// overflow (default 2).
    pub growth_factor: f64,
    /// Multiplies the scale after a step with overflow (default 0.5).
    pub backoff_factor: f64,
    /// Overflow-free steps before the scale grows (default 2000).
    pub growth_interval: u64,
}

impl Default for GradScalerConfig {
    fn default() -> GradScalerConfig {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl GradScalerConfig {
    pub(crate) fn check(&self) -> Result<()> {
        let bad = |field: &str, v: String, why: &str| {
            Err(Error::invalid_config(field, &v, why).with_fix(
                "use torch's defaults: init_scale 65536, growth_factor 2, backoff_factor 0.5, growth_interval 2000",
            ))
        };
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return bad(
                "grad_scaler.init_scale",
                self.init_scale.to_string(),
                "must be a positive number",
            );
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return bad(
                "grad_scaler.growth_factor",
                self.growth_factor.to_string(),
                "must be above 1",
            );
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad(
                "grad_scaler.backoff_factor",
                self.backoff_factor.to_string(),
                "must be in (0, 1)",
            );
        }
        if self.growth_interval == 0 {
            return bad(
                "grad_scaler.growth_interval",
                "0".into(),
                "must be at least 1",
            );
        }
        Ok(())
    }
}

/// The loss scaler's state: the scale and the overflow-free steps since it
/// last changed (what `GradScaler.state_dict()` holds). Saved in
/// checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GradScaler {
    /// The settings.
    pub config: GradScalerConfig,
    /// The current scale.
    pub scale: f64,
    /// Overflow-free optimizer steps since the last change of the scale.
    pub growth_tracker: u64,
}

impl GradScaler {
    /// A scaler at `config.init_scale`.
    pub fn new(config: GradScalerConfig) -> GradScaler {
        GradScaler {
            config,
            scale: config.init_scale,
            growth_tracker: 0,
        }
    }

    /// torch's `update`: back off after an overflow, grow after
    /// `growth_interval` clean steps.
    pub fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.scale *= self.config.backoff_factor;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker >= self.config.growth_interval {
                let grown = self.scale * self.config.growth_factor;
                // torch keeps the old scale when growing would overflow f32.
                if grown.is_finite() && grown <= f64::from(f32::MAX) {
                    self.scale = grown;
                }
                self.growth_tracker = 0;
            }
        }
    }
}

/// Per-run mixed-precision state shared by the accelerator and its wrappers.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct AmpState {
    pub(crate) mode: MixedPrecision,
    /// `Some` in fp16.
    pub(crate) scaler: Option<GradScaler>,
    /// The gradients of the step in progress were unscaled already; with
    /// the agreed overflow flag.
    pub(crate) unscaled: Option<bool>,
    /// The last optimizer step was skipped for an overflow.
    pub(crate) skipped: bool,
    /// Optimizer steps skipped so far.
    pub(crate) skipped_steps: u64,
}

impl AmpState {
    pub(crate) fn new(mode: MixedPrecision, config: GradScalerConfig) -> AmpState {
        AmpState {
            mode,
            scaler: (mode == MixedPrecision::Fp16).then(|| GradScaler::new(config)),
            ..AmpState::default()
        }
    }

    /// The loss multiplier of the scaler (1 without one).
    pub(crate) fn loss_scale(&self) -> f64 {
        self.scaler.map_or(1.0, |s| s.scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaler_backs_off_and_grows_as_torch() {
        let mut s = GradScaler::new(GradScalerConfig {
            growth_interval: 2,
            ..GradScalerConfig::default()
        });
        s.update(true);
        assert_eq!(s.scale, 32768.0);
        s.update(false);
        assert_eq!((s.scale, s.growth_tracker), (32768.0, 1));
        s.update(false);
        assert_eq!((s.scale, s.growth_tracker), (65536.0, 0));
        s.update(false);
        s.update(true);
        assert_eq!((s.scale, s.growth_tracker), (32768.0, 0));
    }

    #[test]
    fn modes_parse_and_bad_settings_are_refused() {
        assert_eq!(
            "BF16".parse::<MixedPrecision>().unwrap(),
            MixedPrecision::Bf16
        );
        assert_eq!(
            "fp16".parse::<MixedPrecision>().unwrap(),
            MixedPrecision::Fp16
        );
        assert_eq!("no".parse::<MixedPrecision>().unwrap(), MixedPrecision::No);
        assert!("fp8".parse::<MixedPrecision>().is_err());
        let bad = GradScalerConfig {
            backoff_factor: 1.5,
            ..GradScalerConfig::default()
        };
        let e = bad.check().unwrap_err().to_string();
        assert!(e.contains("backoff_factor"), "{e}");
        assert!(GradScalerConfig::default().check().is_ok());
    }
}
