//! Experiment trackers: loss and accuracy curves on disk instead of in the
//! logs (Accelerate's `init_trackers` / `log` / `end_training`).
//!
//! Two trackers are built in, both written by the main process only:
//!
//! | name | files under `logging_dir/project_name/` | read with |
//! |---|---|---|
//! | `jsonl` | `metrics.jsonl`: one line per `log`, `{"step": 3, "wall_time": 1764.5, "values": {"loss": 0.41}}`; `config.json` | `jq`, `pandas.read_json(lines=True)` |
//! | `tensorboard` | `events.out.tfevents.<secs>.<host>.<pid>`: scalar summaries; `config.json` | `tensorboard --logdir logging_dir` |
//!
//! A non-finite value is written as `null` in JSON Lines and as is (NaN,
//! ±inf) in TensorBoard. Any other sink implements [`Tracker`] and joins
//! with [`Accelerator::add_tracker`].

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use accel_api::{Error, Result};
use serde::Serialize;

use super::tracker::Tracker;
use crate::Accelerator;

fn io(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::io(format!("{what} {}", path.display()), e).with_op("trackers")
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn write_config(dir: &Path, config: &serde_json::Value) -> Result<()> {
    let path = dir.join("config.json");
    let bytes = serde_json::to_vec_pretty(config).expect("JSON values serialise");
    fs::write(&path, bytes).map_err(|e| io("cannot write", &path, e))
}

fn create_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| io("cannot create", dir, e))
}

/// Writes `metrics.jsonl`, one JSON object per [`log`](Tracker::log),
/// flushed at once (a crashed run keeps every line it logged).
#[derive(Debug)]
pub struct JsonlTracker {
    dir: PathBuf,
    path: PathBuf,
    out: BufWriter<File>,
}

impl JsonlTracker {
    /// A tracker appending to `dir/metrics.jsonl` (created with `dir`).
    ///
    /// # Errors
    /// [`ErrorKind::Io`](accel_api::ErrorKind::Io) naming the path.
    pub fn new(dir: impl AsRef<Path>) -> Result<JsonlTracker> {
        let dir = dir.as_ref().to_path_buf();
        create_dir(&dir)?;
        let path = dir.join("metrics.jsonl");
        let file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| io("cannot open", &path, e))?;
        Ok(JsonlTracker {
            dir,
            path,
            out: BufWriter::new(file),
        })
    }

    /// The file it writes.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[derive(Serialize)]
struct Line<'a> {
    step: u64,
    wall_time: f64,
    values: std::collections::BTreeMap<&'a str, Option<f64>>,
}

impl Tracker for JsonlTracker {
    fn name(&self) -> &str {
        "jsonl"
    }
    fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()> {
        write_config(&self.dir, config)
    }
    fn log(&mut self, values: &[(&str, f64)], step: u64) -> Result<()> {
        let line = Line {
            step,
            wall_time: now(),
            values: values
                .iter()
                .map(|&(k, v)| (k, v.is_finite().then_some(v)))
                .collect(),
        };
        let mut bytes = serde_json::to_vec(&line).expect("a line serialises");
        bytes.push(b'\n');
        self.out
            .write_all(&bytes)
            .and_then(|()| self.out.flush())
            .map_err(|e| io("cannot write", &self.path, e))
    }
    fn finish(&mut self) -> Result<()> {
        self.out
            .flush()
            .and_then(|()| self.out.get_ref().sync_all())
            .map_err(|e| io("cannot flush", &self.path, e))
    }
}

/// Writes a TensorBoard event file: TFRecord framing (length, masked
/// CRC-32C of the length, the record, masked CRC-32C of the record) around
/// `tensorflow.Event` protocol buffers carrying scalar summaries, the format
/// `tensorboard --logdir` reads. Encoded here by hand: a handful of fields,
/// no protobuf dependency.
#[derive(Debug)]
pub struct TensorBoardTracker {
    dir: PathBuf,
    path: PathBuf,
    out: BufWriter<File>,
}

impl TensorBoardTracker {
    /// A tracker writing a new event file in `dir` (created).
    ///
    /// # Errors
    /// [`ErrorKind::Io`](accel_api::ErrorKind::Io) naming the path.
    pub fn new(dir: impl AsRef<Path>) -> Result<TensorBoardTracker> {
        let dir = dir.as_ref().to_path_buf();
        create_dir(&dir)?;
        let host = fs::read_to_string("/etc/hostname")
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty() && !h.contains('/'))
            .unwrap_or_else(|| "accel".to_string());
        let secs = now() as u64;
        let path = dir.join(format!(
            "events.out.tfevents.{secs}.{host}.{}",
            std::process::id()
        ));
        let file = File::create(&path).map_err(|e| io("cannot create", &path, e))?;
        let mut t = TensorBoardTracker {
            dir,
            path,
            out: BufWriter::new(file),
        };
        let mut first = Vec::new();
        proto::double(&mut first, 1, now());
        proto::bytes(&mut first, 3, b"brain.Event:2");
        t.record(&first)?;
        Ok(t)
    }

    /// The event file it writes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut frame = Vec::with_capacity(data.len() + 16);
        frame.extend_from_slice(&len);
        frame.extend_from_slice(&crc::masked(&len).to_le_bytes());
        frame.extend_from_slice(data);
        frame.extend_from_slice(&crc::masked(data).to_le_bytes());
        self.out
            .write_all(&frame)
            .and_then(|()| self.out.flush())
            .map_err(|e| io("cannot write", &self.path, e))
    }
}

impl Tracker for TensorBoardTracker {
    fn name(&self) -> &str {
        "tensorboard"
    }
    fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()> {
        write_config(&self.dir, config)
    }
    fn log(&mut self, values: &[(&str, f64)], step: u64) -> Result<()> {
        let mut summary = Vec::new();
        for &(tag, v) in values {
            let mut value = Vec::new();
            proto::bytes(&mut value, 1, tag.as_bytes());
            proto::float(&mut value, 2, v as f32);
            proto::bytes(&mut summary, 1, &value);
        }
        let mut event = Vec::new();
        proto::double(&mut event, 1, now());
        proto::varint_field(&mut event, 2, step);
        proto::bytes(&mut event, 5, &summary);
        self.record(&event)
    }
    fn finish(&mut self) -> Result<()> {
        self.out
            .flush()
            .and_then(|()| self.out.get_ref().sync_all())
            .map_err(|e| io("cannot flush", &self.path, e))
    }
}

/// The protocol-buffer wire format, as far as events need it.
mod proto {
    pub fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
        varint(out, (u64::from(field) << 3) | u64::from(wire));
    }
    pub fn varint_field(out: &mut Vec<u8>, field: u32, v: u64) {
        key(out, field, 0);
        varint(out, v);
    }
    pub fn double(out: &mut Vec<u8>, field: u32, v: f64) {
        key(out, field, 1);
        out.extend_from_slice(&v.to_le_bytes());
    }
    pub fn float(out: &mut Vec<u8>, field: u32, v: f32) {
        key(out, field, 5);
        out.extend_from_slice(&v.to_le_bytes());
    }
    pub fn bytes(out: &mut Vec<u8>, field: u32, b: &[u8]) {
        key(out, field, 2);
        varint(out, b.len() as u64);
        out.extend_from_slice(b);
    }
}

/// CRC-32C (Castagnoli), masked as TFRecord wants it.
mod crc {
    const fn table() -> [u32; 256] {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    }
    const TABLE: [u32; 256] = table();

    pub fn crc32c(data: &[u8]) -> u32 {
        !data.iter().fold(!0u32, |c, &b| {
            TABLE[((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8)
        })
    }

    pub fn masked(data: &[u8]) -> u32 {
        let c = crc32c(data);
        c.rotate_right(15).wrapping_add(0xA282_EAD8)
    }

    #[cfg(test)]
    #[test]
    fn known_vector() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }
}

/// What [`Accelerator::init_trackers`] accepts in `log_with`.
pub const TRACKER_NAMES: [&str; 3] = ["jsonl", "tensorboard", "all"];

impl Accelerator {
    /// Start the trackers named in `log_with` (`jsonl`, `tensorboard`, or
    /// `all`) in `logging_dir/project_name/` and give each the run's
    /// hyper-parameters `config` (Accelerate's `init_trackers`). Only the
    /// main process creates files; on the others this only checks the
    /// names. Not collective.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// naming an unknown tracker or a `config` that does not serialise (on
    /// every rank); [`ErrorKind::Io`](accel_api::ErrorKind::Io) naming the
    /// path (main process).
    pub fn init_trackers(
        &self,
        project_name: &str,
        logging_dir: impl AsRef<Path>,
        log_with: &[&str],
        config: &impl Serialize,
    ) -> Result<()> {
        for name in log_with {
            if !TRACKER_NAMES.contains(name) {
                return Err(Error::invalid_argument(
                    "init_trackers",
                    format!("unknown tracker {name:?}"),
                )
                .with_fix("use jsonl, tensorboard or all, or add your own with add_tracker"));
            }
        }
        let config = serde_json::to_value(config).map_err(|e| {
            Error::invalid_argument(
                "init_trackers",
                format!("the configuration does not serialise: {e}"),
            )
        })?;
        if !self.is_main_process() {
            return Ok(());
        }
        let dir = logging_dir.as_ref().join(project_name);
        let all = log_with.contains(&"all");
        let mut made: Vec<Box<dyn Tracker>> = Vec::new();
        if all || log_with.contains(&"jsonl") {
            made.push(Box::new(JsonlTracker::new(&dir)?));
        }
        if all || log_with.contains(&"tensorboard") {
            made.push(Box::new(TensorBoardTracker::new(&dir)?));
        }
        for t in &mut made {
            t.store_init_configuration(&config)?;
        }
        // Kept so that a setting found later not to apply is recorded.
        super::shared(self).lock().applied.tracker_config = Some(config);
        super::shared(self).trackers().extend(made);
        Ok(())
    }

    /// Add a tracker of your own (kept on the main process only, dropped on
    /// the others). Not collective.
    pub fn add_tracker(&self, tracker: Box<dyn Tracker>) {
        if self.is_main_process() {
            super::shared(self).trackers().push(tracker);
        }
    }

    /// The names of the trackers running on this process.
    pub fn trackers(&self) -> Vec<String> {
        super::shared(self)
            .trackers()
            .iter()
            .map(|t| t.name().to_string())
            .collect()
    }

    /// Log scalar `values` at `step` to every tracker (main process only;
    /// elsewhere it does nothing). Not collective: reduce the values first
    /// (for example with [`reduce`](Self::reduce)) to log a global metric.
    ///
    /// # Errors
    /// The first tracker error (the others still get the values).
    pub fn log(&self, values: &[(&str, f64)], step: u64) -> Result<()> {
        if self.is_main_process() {
            // For progress reporters (the launcher's Kubeflow status posts).
            self.watch().set_metrics(values, step);
        }
        let mut first = None;
        for t in super::shared(self).trackers().iter_mut() {
            if let Err(e) = t.log(values, step) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Say how many steps the run will take in all (a Hugging Face
    /// `Trainer`'s `max_steps`): rank status files carry it, so that
    /// `accel launch` can report progress and an ETA (Kubeflow Trainer's
    /// status, docs/multi-machine.md). Not collective; never fails.
    pub fn set_total_steps(&self, steps: u64) {
        self.watch().set_total_steps(steps);
    }

    /// Flush and close every tracker (Accelerate's `end_training`); later
    /// `log` calls go nowhere until `init_trackers` runs again. Waits for
    /// a background save in flight first
    /// ([`wait_for_save`](Self::wait_for_save)).
    ///
    /// # Errors
    /// A failed background save (every tracker is still closed); the first
    /// tracker error.
    pub fn end_training(&self) -> Result<()> {
        // No step bound after training (ACCEL_TIMEOUT_STEP).
        self.watch().idle();
        // A background save's failure is the run's (save_state_async).
        let saved = self.wait_for_save();
        let trackers: Vec<Box<dyn Tracker>> = std::mem::take(&mut *super::shared(self).trackers());
        let mut first = None;
        for mut t in trackers {
            if let Err(e) = t.finish() {
                first.get_or_insert(e);
            }
        }
        saved?;
        first.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_encode_as_protobuf_does() {
        let mut v = Vec::new();
        proto::varint(&mut v, 300);
        assert_eq!(v, vec![0xAC, 0x02]);
        let mut f = Vec::new();
        proto::float(&mut f, 2, 1.0);
        assert_eq!(f, vec![0x15, 0, 0, 0x80, 0x3F]);
    }
}
