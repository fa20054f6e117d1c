//! safetensors files as the model files are made of: a parameter as
//! stored (its shape, element type and bytes), a file of such tensors, and
//! a bounded read of one file. Shared by `model_io.rs` (accel's and
//! `transformers`' layout) and `torch_dcp.rs` (torch's per-rank shards).

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;

use accel_api::{Error, ErrorKind, Result};

use super::adapters::{Parameters, Tensor};

/// `values` in `dtype`'s little-endian bytes (F16, BF16; F32 else).
pub(crate) fn encode_values(values: &[f32], dtype: safetensors::Dtype) -> Vec<u8> {
    use safetensors::Dtype;
    match dtype {
        Dtype::F16 => values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        Dtype::BF16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// A model file that does not read: `Corrupt`, in `load_model`.
pub(crate) fn corrupt(msg: String) -> Error {
    Error::new(ErrorKind::Corrupt, msg).with_op("load_model")
}

/// One tensor as `save_model` stores it: the model's own shape
/// ([`Parameters::param_shape`], else 1-D) and its values' element type.
pub(crate) struct Stored {
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: safetensors::Dtype,
    pub(crate) bytes: Vec<u8>,
}

/// The safetensors file of `tensors` with `metadata` in its header.
pub(crate) fn encode_stored(
    tensors: &BTreeMap<String, Stored>,
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let mut views = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let v = safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.bytes).map_err(
            |e| {
                Error::invalid_argument(
                    "save_model",
                    format!(
                        "tensor {name:?}: shape {:?} does not fit its data: {e}",
                        t.shape
                    ),
                )
            },
        )?;
        views.push((name.as_str(), v));
    }
    safetensors::serialize(views, metadata).map_err(|e| {
        Error::invalid_argument("save_model", format!("cannot encode safetensors: {e}"))
    })
}

/// Every parameter of `model` as [`stored`] stores it, in visiting order.
pub(crate) fn stored_params<P: Parameters + ?Sized>(model: &P) -> Result<Vec<(String, Stored)>> {
    let mut out = Vec::new();
    let mut failed = None;
    let k = model.grad_kernels();
    let k = k.as_deref();
    model.visit_params(&mut |p| {
        if failed.is_some() {
            return;
        }
        match stored(k, p.name, p.value, model.param_shape(p.name)) {
            Ok(t) => out.push((p.name.to_string(), t)),
            Err(e) => failed = Some(e),
        }
    });
    match failed {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// How `save_model` stores parameter `name` with values `value`: in the
/// model's shape (1-D when it gives none), in the values' own element type
/// (host bytes as they are; device values through `f32`).
fn stored(
    k: Option<&dyn super::kernels::GradKernels>,
    name: &str,
    value: accel_api::Buf<'_>,
    shape: Option<Vec<usize>>,
) -> Result<Stored> {
    use accel_api::Buf;
    use safetensors::Dtype;
    let n = value.len();
    let shape = shape.unwrap_or_else(|| vec![n]);
    if shape.iter().product::<usize>() != n {
        return Err(Error::invalid_argument(
            "save_model",
            format!("parameter {name:?} has {n} values but its shape is {shape:?}"),
        )
        .with_fix("param_shape must give the shape of the parameter's values"));
    }
    let Some(dtype) = file_dtype(value.dtype()) else {
        return Err(Error::invalid_argument(
            "save_model",
            format!(
                "parameter {name:?} is {}; weights are floating point",
                value.dtype()
            ),
        ));
    };
    let bytes = match value {
        Buf::Host(h) => h.bytes().to_vec(),
        Buf::Device(_) => {
            let data = super::grads::read_f32(k, name, value)?;
            match dtype {
                Dtype::F64 => data
                    .iter()
                    .flat_map(|x| f64::from(*x).to_le_bytes())
                    .collect(),
                _ => encode_values(&data, dtype),
            }
        }
    };
    Ok(Stored {
        shape,
        dtype,
        bytes,
    })
}

/// The safetensors element type of a floating-point parameter.
pub(crate) fn file_dtype(t: accel_api::DType) -> Option<safetensors::Dtype> {
    use accel_api::DType;
    use safetensors::Dtype;
    match t {
        DType::F16 => Some(Dtype::F16),
        DType::BF16 => Some(Dtype::BF16),
        DType::F32 => Some(Dtype::F32),
        DType::F64 => Some(Dtype::F64),
        _ => None,
    }
}

/// safetensors' own bound on a header (100 MB).
const MAX_HEADER: u64 = 100_000_000;

/// Read the safetensors file `f` (opened from `path`, a regular file),
/// never more than its header declares: the header length, then the
/// header, then exactly the data its offsets cover, which must be the rest
/// of the file.
pub(crate) fn read_safetensors(path: &Path, f: fs::File) -> Result<Vec<u8>> {
    use std::io::Read;
    let len = f
        .metadata()
        .map_err(|e| Error::io(format!("cannot stat {}", path.display()), e))?
        .len();
    let bad = |m: String| corrupt(format!("{}: {m}", path.display()));
    let io = |e| Error::io(format!("cannot read {}", path.display()), e);
    let mut r = f.take(len);
    let mut n = [0u8; 8];
    r.read_exact(&mut n)
        .map_err(|_| bad(format!("{len} bytes, too short for a safetensors header")))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || 8 + n > len {
        return Err(bad(format!(
            "not safetensors: header length {n}, file of {len} bytes"
        )));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    bytes.extend_from_slice(&n.to_le_bytes());
    (&mut r).take(n).read_to_end(&mut bytes).map_err(io)?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..])
        .map_err(|e| {
            bad(format!(
                "not safetensors: the header is not a JSON object: {e}"
            ))
        })?;
    let end = header
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .map(|(_, v)| v["data_offsets"][1].as_u64())
        .try_fold(0u64, |m, e| e.map(|e| m.max(e)))
        .ok_or_else(|| bad("not safetensors: a tensor without data_offsets".to_string()))?;
    let declared = 8 + n + end;
    if declared != len {
        return Err(bad(format!(
            "holds {len} bytes, its header declares {declared}: truncated or padded"
        )));
    }
    r.read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 != len {
        return Err(bad(format!(
            "changed while being read ({} of {len} bytes)",
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// The tensors of a model folder (as `f32`) and each one's stored type.
pub(crate) type ReadModel = (
    BTreeMap<String, Tensor>,
    BTreeMap<String, safetensors::Dtype>,
);
