//! Floating-point dtype conversion for loading with a dtype override.

use accel_api::{DType, Error, Result};
use half::{bf16, f16};

fn read_f64(d: DType, b: &[u8], i: usize) -> f64 {
    let s = d.size();
    let c = &b[i * s..(i + 1) * s];
    match d {
        DType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f64(),
        DType::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f64(),
        DType::F32 => f32::from_le_bytes(c.try_into().expect("4")) as f64,
        _ => f64::from_le_bytes(c.try_into().expect("8")),
    }
}

/// Convert `data` from `from` to `to` (both floating-point), rounding to
/// nearest. Returns `None` when no conversion is needed.
pub fn convert(from: DType, to: DType, data: &[u8]) -> Result<Option<Vec<u8>>> {
    if from == to {
        return Ok(None);
    }
    if !from.is_float() || !to.is_float() {
        return Err(Error::invalid_argument(
            "convert",
            format!("cannot convert {from} to {to}"),
        ));
    }
    let n = data.len() / from.size();
    let mut out = Vec::with_capacity(n * to.size());
    for i in 0..n {
        let v = read_f64(from, data, i);
        match to {
            DType::F16 => out.extend_from_slice(&f16::from_f64(v).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
            DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            _ => out.extend_from_slice(&v.to_le_bytes()),
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_to_f16_and_back() {
        let src: Vec<u8> = [1.0f32, -2.5, 65504.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let h = convert(DType::F32, DType::F16, &src).unwrap().unwrap();
        assert_eq!(h.len(), 6);
        let back = convert(DType::F16, DType::F32, &h).unwrap().unwrap();
        assert_eq!(back, src);
        assert!(convert(DType::F32, DType::F32, &src).unwrap().is_none());
        assert!(convert(DType::I32, DType::F16, &src).is_err());
    }
}
