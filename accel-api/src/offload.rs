use std::borrow::Cow;

use crate::{DType, Result};

/// Element type and shape of a stored tensor.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TensorMeta {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first (empty for a scalar).
    pub shape: Vec<usize>,
}

impl TensorMeta {
    /// Number of elements (1 for a scalar), or `None` when it does not fit
    /// in `usize`.
    pub fn checked_numel(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
    }

    /// Size of the data in bytes, or `None` when it does not fit in `usize`.
    pub fn checked_byte_len(&self) -> Option<usize> {
        self.checked_numel()?.checked_mul(self.dtype.size())
    }

    /// Number of elements (1 for a scalar).
    ///
    /// # Panics
    /// When the count does not fit in `usize` (a shape from untrusted input:
    /// use [`checked_numel`](TensorMeta::checked_numel) there).
    pub fn numel(&self) -> usize {
        self.checked_numel()
            .unwrap_or_else(|| panic!("tensor shape {:?} overflows usize", self.shape))
    }

    /// Size of the data in bytes.
    ///
    /// # Panics
    /// As [`numel`](TensorMeta::numel); use
    /// [`checked_byte_len`](TensorMeta::checked_byte_len) on untrusted shapes.
    pub fn byte_len(&self) -> usize {
        self.checked_byte_len()
            .unwrap_or_else(|| panic!("tensor shape {:?} overflows usize", self.shape))
    }
}

/// Named tensors kept off the execution device (host RAM, disk) for
/// big-model inference.
///
/// Implementations are shared between the executor and its prefetch thread,
/// so every method takes `&self`.
///
/// # Errors common to every method
/// * [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument): no
///   tensor of that name (the error names it).
/// * [`ErrorKind::Corrupt`](crate::ErrorKind::Corrupt): stored bytes disagree
///   with the metadata (truncated file, lying header), naming file and tensor.
/// * [`ErrorKind::Io`](crate::ErrorKind::Io): the medium failed.
pub trait OffloadStore: Send + Sync {
    /// The bytes of `name` (native endianness, row-major), borrowed without a
    /// copy where the medium allows (memory-mapped files, host RAM).
    fn get(&self, name: &str) -> Result<Cow<'_, [u8]>>;

    /// Store `data` under `name`, replacing any previous tensor atomically.
    ///
    /// Requires: `data.len() == meta.byte_len()`
    /// ([`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument)
    /// otherwise).
    fn put(&self, name: &str, meta: TensorMeta, data: &[u8]) -> Result<()>;

    /// `true` when `name` is stored.
    fn contains(&self, name: &str) -> bool;

    /// Every stored name, sorted.
    fn keys(&self) -> Vec<String>;

    /// Element type and shape of `name`.
    fn meta(&self, name: &str) -> Result<TensorMeta>;
}
