//! Host copies of burn tensors in their own element type: what accel's
//! views borrow.

use accel_api::{Buf, BufMut, Error, ErrorKind, Result};
use burn::tensor::{DType, TensorData};
use half::{bf16, f16};

/// A flat host buffer of one float element type.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum HostVec {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

/// Whether accel-burn trains parameters of `dtype`.
pub(crate) fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}

fn data_err(op: &str, e: impl std::fmt::Debug) -> Error {
    Error::new(ErrorKind::Backend, format!("burn: {op}: {e:?}"))
}

impl HostVec {
    /// `n` zeros of `dtype` (a float type: checked by the caller).
    pub(crate) fn zeros(dtype: DType, n: usize) -> HostVec {
        match dtype {
            DType::F64 => HostVec::F64(vec![0.0; n]),
            DType::F16 => HostVec::F16(vec![f16::ZERO; n]),
            DType::BF16 => HostVec::BF16(vec![bf16::ZERO; n]),
            _ => HostVec::F32(vec![0.0; n]),
        }
    }

    /// `values` in `dtype` (rounded once).
    pub(crate) fn from_f32(dtype: DType, values: &[f32]) -> HostVec {
        match dtype {
            DType::F64 => HostVec::F64(values.iter().map(|&v| f64::from(v)).collect()),
            DType::F16 => HostVec::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
            DType::BF16 => HostVec::BF16(values.iter().map(|&v| bf16::from_f32(v)).collect()),
            _ => HostVec::F32(values.to_vec()),
        }
    }

    /// A copy of `data`'s elements (one copy out of burn).
    ///
    /// # Errors
    /// [`ErrorKind::Backend`] when `data` is not of a float type.
    pub(crate) fn from_data(data: &TensorData) -> Result<HostVec> {
        Ok(match data.dtype() {
            DType::F32 => HostVec::F32(
                data.as_slice::<f32>()
                    .map_err(|e| data_err("read", e))?
                    .to_vec(),
            ),
            DType::F64 => HostVec::F64(
                data.as_slice::<f64>()
                    .map_err(|e| data_err("read", e))?
                    .to_vec(),
            ),
            DType::F16 => HostVec::F16(
                data.as_slice::<f16>()
                    .map_err(|e| data_err("read", e))?
                    .to_vec(),
            ),
            DType::BF16 => HostVec::BF16(
                data.as_slice::<bf16>()
                    .map_err(|e| data_err("read", e))?
                    .to_vec(),
            ),
            other => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!(
                    "accel-burn: a tensor of {other:?}; it trains f32, f64, f16 and bf16 tensors"
                ),
                ))
            }
        })
    }

    /// The elements as burn data of `shape` (one copy into burn).
    pub(crate) fn to_data(&self, shape: &[usize]) -> TensorData {
        match self {
            HostVec::F32(v) => TensorData::new(v.clone(), shape.to_vec()),
            HostVec::F64(v) => TensorData::new(v.clone(), shape.to_vec()),
            HostVec::F16(v) => TensorData::new(v.clone(), shape.to_vec()),
            HostVec::BF16(v) => TensorData::new(v.clone(), shape.to_vec()),
        }
    }

    /// Add `data`'s elements (same element type and length) into this
    /// buffer: the gradient's copy from burn, which is also accumulation.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for another length or element type.
    pub(crate) fn add_data(&mut self, name: &str, data: &TensorData) -> Result<()> {
        fn add<T: Copy + std::ops::Add<Output = T> + burn::tensor::Element>(
            name: &str,
            dst: &mut [T],
            data: &TensorData,
        ) -> Result<()> {
            let src = data.as_slice::<T>().map_err(|e| {
                Error::invalid_argument(
                    "BurnModel::add_grads",
                    format!("the gradient of {name:?}: {e:?}"),
                )
            })?;
            if src.len() != dst.len() {
                return Err(Error::invalid_argument(
                    "BurnModel::add_grads",
                    format!(
                        "the gradient of {name:?} has {} elements, the parameter {}",
                        src.len(),
                        dst.len()
                    ),
                ));
            }
            for (d, s) in dst.iter_mut().zip(src) {
                *d = *d + *s;
            }
            Ok(())
        }
        match self {
            HostVec::F32(v) => add(name, v, data),
            HostVec::F64(v) => add(name, v, data),
            HostVec::F16(v) => add(name, v, data),
            HostVec::BF16(v) => add(name, v, data),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            HostVec::F32(v) => v.len(),
            HostVec::F64(v) => v.len(),
            HostVec::F16(v) => v.len(),
            HostVec::BF16(v) => v.len(),
        }
    }

    /// Free (`n == 0`) or resize to `n` elements, zero-filled where it grows.
    pub(crate) fn resize(&mut self, n: usize) {
        fn go<T: Clone>(v: &mut Vec<T>, n: usize, zero: T) {
            if n == 0 {
                *v = Vec::new();
            } else {
                v.resize(n, zero);
            }
        }
        match self {
            HostVec::F32(v) => go(v, n, 0.0),
            HostVec::F64(v) => go(v, n, 0.0),
            HostVec::F16(v) => go(v, n, f16::ZERO),
            HostVec::BF16(v) => go(v, n, bf16::ZERO),
        }
    }

    pub(crate) fn buf(&self) -> Buf<'_> {
        match self {
            HostVec::F32(v) => Buf::from(&v[..]),
            HostVec::F64(v) => Buf::from(&v[..]),
            HostVec::F16(v) => Buf::from(&v[..]),
            HostVec::BF16(v) => Buf::from(&v[..]),
        }
    }

    pub(crate) fn buf_mut(&mut self) -> BufMut<'_> {
        match self {
            HostVec::F32(v) => BufMut::from(&mut v[..]),
            HostVec::F64(v) => BufMut::from(&mut v[..]),
            HostVec::F16(v) => BufMut::from(&mut v[..]),
            HostVec::BF16(v) => BufMut::from(&mut v[..]),
        }
    }
}
