//! Mixed precision: the mode (`no`, `bf16`, `fp16`), torch's dynamic loss
//! scaler for fp16, and the per-step state (unscaled yet? overflow found?
//! step skipped?) the optimizer, the scheduler and clipping share.

use accel_api::{Error, Result};
use serde::{Deserialize, Serialize};

/// The environment variable `accel launch --mixed-precision` sets (as
/// Accelerate's `ACCELERATE_MIXED_PRECISION`).
pub const MIXED_PRECISION_ENV: &str = accel_api::worker::keys::ACCEL_MIXED_PRECISION;

/// Mixed-precision mode (Accelerate's `mixed_precision`): a protocol value
/// of the worker environment (`accel_api::worker`), re-exported where the
/// training loop has always named it. In fp16 the loss is scaled by a
/// [`GradScaler`].
pub use accel_api::worker::MixedPrecision;

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
        let as_f32 = self.init_scale as f32;
        if !(as_f32.is_finite() && as_f32 > 0.0) {
            return bad(
                "grad_scaler.init_scale",
                self.init_scale.to_string(),
                "must be a positive number that fits in f32 (the scale is kept in f32, as torch's)",
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
///
/// The scale is an `f32`, as torch's `_scale` tensor: every update
/// multiplies it by the `f64` factor and rounds the product to `f32`
/// (torch's `_amp_update_scale_` kernel), so a non-power-of-two factor
/// gives torch's trajectory step for step (16777216 x 0.9 is 15099494,
/// not 15099494.4).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(from = "SavedScaler")]
pub struct GradScaler {
    /// The settings.
    pub config: GradScalerConfig,
    /// The current scale.
    pub scale: f32,
    /// Overflow-free optimizer steps since the last change of the scale.
    pub growth_tracker: u64,
}

/// The scaler as checkpoints store it. Checkpoints written before the scale
/// was kept in `f32` hold an `f64` scale; it is read as a number and
/// rounded to the nearest `f32` (the format is the same JSON number, so
/// the checkpoint version did not change).
#[derive(Deserialize)]
struct SavedScaler {
    config: GradScalerConfig,
    scale: f64,
    growth_tracker: u64,
}

impl From<SavedScaler> for GradScaler {
    fn from(s: SavedScaler) -> GradScaler {
        let scale = s.scale as f32;
        if f64::from(scale) != s.scale {
            tracing::info!(
                saved = s.scale,
                rounded = f64::from(scale),
                "the checkpoint's loss scale (an f64, written by an older accel) is rounded to f32, \
                 as torch's GradScaler keeps it"
            );
        }
        GradScaler {
            config: s.config,
            scale,
            growth_tracker: s.growth_tracker,
        }
    }
}

impl GradScaler {
    /// A scaler at `config.init_scale` (rounded to `f32`, as torch's
    /// `torch.full((), init_scale, dtype=torch.float32)`).
    pub fn new(config: GradScalerConfig) -> GradScaler {
        GradScaler {
            config,
            scale: config.init_scale as f32,
            growth_tracker: 0,
        }
    }

    /// The factor the gradients are unscaled by: `1 / scale` computed in
    /// `f64` and rounded to `f32`, as torch's
    /// `self._scale.double().reciprocal().float()`.
    pub fn inv_scale(&self) -> f32 {
        (1.0 / f64::from(self.scale)) as f32
    }

    /// torch's `update` (`_amp_update_scale_`): after an overflow the scale
    /// backs off and the tracker restarts; after `growth_interval` clean
    /// steps it grows unless the grown `f32` would be infinite. Each new
    /// scale is the `f32` product rounded from `f64`.
    pub fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.scale = (f64::from(self.scale) * self.config.backoff_factor) as f32;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker >= self.config.growth_interval {
                let grown = (f64::from(self.scale) * self.config.growth_factor) as f32;
                if grown.is_finite() {
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
        self.scaler.map_or(1.0, |s| f64::from(s.scale))
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

    /// torch's `_amp_update_scale_` CPU kernel, written out as torch has
    /// it: an `f32` scale tensor, an `int32` tracker, the factors as C++
    /// `double`s; `float * double` is computed in double and stored back
    /// into the float (`static_cast<float>`), which Rust's `as f32` does
    /// too (round to nearest even).
    fn torch_update(scale: &mut f32, tracker: &mut i32, found_inf: bool, c: &GradScalerConfig) {
        if found_inf {
            *scale = (*scale as f64 * c.backoff_factor) as f32;
            *tracker = 0;
        } else {
            let successful = *tracker + 1;
            if successful as u64 == c.growth_interval {
                let new_scale = (*scale as f64 * c.growth_factor) as f32;
                if new_scale.is_finite() {
                    *scale = new_scale;
                }
                *tracker = 0;
            } else {
                *tracker = successful;
            }
        }
    }

    #[test]
    fn scaler_replays_torchs_f32_trajectory_with_non_power_of_two_factors() {
        // torch is not installed in the test environments (no `torch` in
        // .venv-tb or .accel-cache/torch-venv), so the expected trajectory
        // is torch's kernel rule above, in the same IEEE arithmetic.
        let c = GradScalerConfig {
            init_scale: 16777216.0,
            growth_factor: 1.5,
            backoff_factor: 0.9,
            growth_interval: 3,
        };
        // The issue's example: torch stores 15099494.0, an f64 scaler
        // 15099494.4.
        let mut one = GradScaler::new(c);
        one.update(true);
        assert_eq!(one.scale, 15099494.0);
        assert_eq!(16777216.0f64 * 0.9, 15099494.4);

        let mut s = GradScaler::new(c);
        let (mut want, mut tracker) = (c.init_scale as f32, 0i32);
        let mut f64_scale = c.init_scale;
        let mut rng = 0x2545_f491_4f6c_dd1du64; // xorshift64: a fixed random pattern
        let (mut steps, mut overflows, mut differs_from_f64) = (0, 0, 0);
        for step in 0..600 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let found_inf = rng.is_multiple_of(4);
            s.update(found_inf);
            torch_update(&mut want, &mut tracker, found_inf, &c);
            assert_eq!(
                (s.scale.to_bits(), s.growth_tracker),
                (want.to_bits(), tracker as u64),
                "step {step}: accel {} / {}, torch {want} / {tracker}",
                s.scale,
                s.growth_tracker
            );
            // What an f64 scaler (accel before) would hold.
            if found_inf {
                f64_scale *= c.backoff_factor;
            } else if tracker == 0 {
                f64_scale *= c.growth_factor;
            }
            if f64::from(s.scale) != f64_scale {
                differs_from_f64 += 1;
            }
            steps += 1;
            overflows += usize::from(found_inf);
        }
        assert_eq!(steps, 600);
        assert!((100..200).contains(&overflows), "{overflows} overflows");
        // The test tells the two rules apart: most steps differ once the
        // first inexact product is rounded.
        assert!(differs_from_f64 > 100, "{differs_from_f64} steps differ");
    }

    #[test]
    fn growth_stops_where_f32_would_overflow_and_unscaling_uses_torchs_reciprocal() {
        let mut s = GradScaler::new(GradScalerConfig {
            init_scale: f64::from(f32::MAX) / 1.5,
            growth_factor: 2.0,
            growth_interval: 1,
            ..GradScalerConfig::default()
        });
        let before = s.scale;
        s.update(false);
        assert_eq!(
            (s.scale, s.growth_tracker),
            (before, 0),
            "kept: 2x is inf in f32"
        );
        // 1/3 in f64 rounded to f32, torch's `_scale.double().reciprocal().float()`.
        let t = GradScaler {
            scale: 3.0,
            ..GradScaler::new(GradScalerConfig::default())
        };
        assert_eq!(t.inv_scale(), (1.0f64 / 3.0) as f32);
    }

    #[test]
    fn an_older_f64_scale_in_a_checkpoint_is_rounded_to_f32() {
        let saved = r#"{"config":{"init_scale":65536.0,"growth_factor":1.5,"backoff_factor":0.9,"growth_interval":3},"scale":15099494.4,"growth_tracker":2}"#;
        let s: GradScaler = serde_json::from_str(saved).unwrap();
        assert_eq!((s.scale, s.growth_tracker), (15099494.0, 2));
        // And what is written now reads back bit for bit.
        let back: GradScaler = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
        let odd = GradScaler { scale: 0.1f32, ..s };
        let back: GradScaler = serde_json::from_str(&serde_json::to_string(&odd).unwrap()).unwrap();
        assert_eq!(back.scale.to_bits(), 0.1f32.to_bits());
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
        for huge_or_tiny in [1e39, 1e-50] {
            let bad = GradScalerConfig {
                init_scale: huge_or_tiny,
                ..GradScalerConfig::default()
            };
            let e = bad.check().unwrap_err().to_string();
            assert!(e.contains("init_scale") && e.contains("f32"), "{e}");
        }
        assert!(GradScalerConfig::default().check().is_ok());
    }
}
