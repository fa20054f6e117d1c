//! The [`Tracker`] trait: where the training loop's logged scalars go.

use accel_api::Result;

/// A sink for logged scalars.
///
/// # Behavior
/// The accelerator calls these on the main process only, in order:
/// [`store_init_configuration`](Self::store_init_configuration) from
/// [`Accelerator::init_trackers`](crate::Accelerator::init_trackers) (and
/// again, with the value that applied and a `not_applied` entry, when a
/// mixed-precision or sharding setting turns out not to apply; see
/// [`Accelerator::settings_not_applied`](crate::Accelerator::settings_not_applied)),
/// [`log`](Self::log) per
/// [`Accelerator::log`](crate::Accelerator::log), and [`finish`](Self::finish) from
/// [`Accelerator::end_training`](crate::Accelerator::end_training).
pub trait Tracker: Send {
    /// Short name (`jsonl`, `tensorboard`, ...).
    fn name(&self) -> &str;

    /// Record the run's hyper-parameters (replacing what an earlier call
    /// recorded).
    ///
    /// # Errors
    /// The sink's (an I/O error naming the file).
    fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()>;

    /// Record `values` at `step`.
    ///
    /// # Errors
    /// The sink's.
    fn log(&mut self, values: &[(&str, f64)], step: u64) -> Result<()>;

    /// Flush and close.
    ///
    /// # Errors
    /// The sink's.
    fn finish(&mut self) -> Result<()>;
}
