use std::fmt;

/// The family of a device. Backends declare the one kind they drive.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum DeviceKind {
    /// Host memory and CPU compute.
    Cpu,
    /// An NVIDIA GPU driven through CUDA.
    Cuda,
    /// A device behind a PJRT plugin (TPU, GPU or the PJRT CPU client).
    Xla,
    /// An Ascend NPU.
    Npu,
}

named_codes!(DeviceKind, name: "Lower-case name.", {
    Cpu => 1, "cpu";
    Cuda => 2, "cuda";
    Xla => 3, "xla";
    Npu => 4, "npu";
});

/// One device: a kind and an ordinal among the devices of that kind visible
/// to the process (after `CUDA_VISIBLE_DEVICES` and similar masks).
///
/// Displays as `cpu`, `cuda:1`, `xla:0`, `npu:3`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct Device {
    /// Family.
    pub kind: DeviceKind,
    /// Ordinal among the visible devices of this kind (0 for the CPU).
    pub index: u32,
}

impl Device {
    /// The host CPU.
    pub const CPU: Device = Device {
        kind: DeviceKind::Cpu,
        index: 0,
    };

    /// A device of `kind` with ordinal `index`.
    pub const fn new(kind: DeviceKind, index: u32) -> Device {
        Device { kind, index }
    }

    /// `true` when the device is the host CPU.
    pub const fn is_cpu(&self) -> bool {
        matches!(self.kind, DeviceKind::Cpu)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            DeviceKind::Cpu => f.write_str("cpu"),
            k => write!(f, "{}:{}", k, self.index),
        }
    }
}
