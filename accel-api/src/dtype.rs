use std::fmt;
use std::str::FromStr;

use crate::{Error, ErrorKind};

/// The element type of a buffer taking part in a collective.
///
/// `DType` is a plain tag; the data itself travels as bytes inside a
/// [`HostBuf`](crate::HostBuf) or [`DeviceBuf`](crate::DeviceBuf). The
/// spelling used by [`DType::name`] and [`FromStr`] is the lower-case Rust
/// name (`f32`, `bf16`, ...), which is also what `--dtype` flags accept.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum DType {
    /// IEEE 754 half precision ([`half::f16`]).
    F16,
    /// bfloat16 ([`half::bf16`]).
    BF16,
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 double precision.
    F64,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
}

impl DType {
    /// Every element type, in declaration order.
    pub const ALL: [DType; 8] = [
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::I64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// `true` for the four floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }
}

named_codes!(DType, name: "Lower-case name, as accepted by [`FromStr`].", {
    F16 => 1, "f16";
    BF16 => 2, "bf16";
    F32 => 3, "f32";
    F64 => 4, "f64";
    I8 => 5, "i8";
    U8 => 6, "u8";
    I32 => 7, "i32";
    I64 => 8, "i64";
});

impl FromStr for DType {
    type Err = Error;

    /// Parses `f16`, `bf16`, `f32`, `f64`, `i8`, `u8`, `i32`, `i64` (and the
    /// common aliases `float16`, `bfloat16`, `float32`, `float64`, `int8`,
    /// `uint8`, `int32`, `int64`).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming the unknown spelling.
    fn from_str(s: &str) -> Result<Self, Error> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "f16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "f32" | "float32" | "float" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "i8" | "int8" => DType::I8,
            "u8" | "uint8" => DType::U8,
            "i32" | "int32" => DType::I32,
            "i64" | "int64" => DType::I64,
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("unknown dtype `{other}`"),
                )
                .with_fix("use one of f16, bf16, f32, f64, i8, u8, i32, i64"))
            }
        })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that can travel in a collective: `f16`, `bf16`, `f32`, `f64`,
/// `i8`, `u8`, `i32`, `i64`.
///
/// The trait is sealed: the set of element types is part of the contract and
/// every backend's capability table is written against it.
pub trait Element: bytemuck::Pod + PartialOrd + fmt::Debug + Send + Sync + sealed::Sealed {
    /// The tag for this type.
    const DTYPE: DType;
    /// Widen to `f64` (exact for every type but `i64` beyond 2^53).
    fn to_f64(self) -> f64;
    /// Narrow from `f64`, rounding to nearest (saturating for integers).
    fn from_f64(v: f64) -> Self;
}

/// Evaluates `$body` with the type `$T` bound to the Rust type of the
/// float [`DType`] `$dtype` (f16, bf16, f32, f64), or `$other` for the
/// rest.
///
/// ```
/// use accel_api::{with_float, DType, Element};
/// let size = |d: DType| with_float!(d, T => std::mem::size_of::<T>(), else 0);
/// assert_eq!((size(DType::BF16), size(DType::F64), size(DType::I32)), (2, 8, 0));
/// ```
#[macro_export]
macro_rules! with_float {
    ($dtype:expr, $T:ident => $body:expr, else $other:expr) => {
        match $dtype {
            $crate::DType::F16 => {
                type $T = $crate::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::bf16;
                $body
            }
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            _ => $other,
        }
    };
}

/// Evaluates `$body` with the type `$T` bound to the Rust type of
/// `$dtype`, for every [`DType`] with one; `$other` otherwise (`DType` is
/// non-exhaustive).
///
/// ```
/// use accel_api::{with_dtype, DType, Element};
/// let code = |d: DType| with_dtype!(d, T => <T as Element>::DTYPE.size(), else 0);
/// assert_eq!((code(DType::U8), code(DType::F16)), (1, 2));
/// ```
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr, else $other:expr) => {
        match $dtype {
            $crate::DType::I8 => {
                type $T = i8;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            float => $crate::with_float!(float, $T => $body, else $other),
        }
    };
}

macro_rules! element {
    ($t:ty, $d:expr, $to:expr, $from:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            fn to_f64(self) -> f64 {
                ($to)(self)
            }
            fn from_f64(v: f64) -> Self {
                ($from)(v)
            }
        }
    };
}

element!(
    half::f16,
    DType::F16,
    |x: half::f16| x.to_f64(),
    half::f16::from_f64
);
element!(
    half::bf16,
    DType::BF16,
    |x: half::bf16| x.to_f64(),
    half::bf16::from_f64
);
element!(f32, DType::F32, |x: f32| x as f64, |v: f64| v as f32);
element!(f64, DType::F64, |x: f64| x, |v: f64| v);
element!(i8, DType::I8, |x: i8| x as f64, |v: f64| v.round() as i8);
element!(u8, DType::U8, |x: u8| x as f64, |v: f64| v.round() as u8);
element!(i32, DType::I32, |x: i32| x as f64, |v: f64| v.round()
    as i32);
element!(i64, DType::I64, |x: i64| x as f64, |v: f64| v.round()
    as i64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_names_parse() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Some(d));
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert_eq!(DType::from_code(0), None);
        let err = "f12".parse::<DType>().unwrap_err();
        assert!(err.to_string().contains("f12"), "{err}");
    }

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DType::F16.size(), std::mem::size_of::<half::f16>());
        assert_eq!(DType::BF16.size(), std::mem::size_of::<half::bf16>());
        assert_eq!(DType::I64.size(), std::mem::size_of::<i64>());
        assert_eq!(<u8 as Element>::DTYPE, DType::U8);
    }
}

/// A 16-bit float type, and the one widening to f32 and narrowing back
/// (round to nearest even, once) that engines and the facade share: an
/// engine without native 16-bit reductions (MPI) reduces in f32, and the
/// facade reads 16-bit checkpoints and compressed gradients in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half16 {
    /// IEEE 754 half precision.
    F16,
    /// bfloat16.
    BF16,
}

impl Half16 {
    /// The 16-bit float type `d` is, if it is one.
    pub fn of(d: DType) -> Option<Half16> {
        match d {
            DType::F16 => Some(Half16::F16),
            DType::BF16 => Some(Half16::BF16),
            _ => None,
        }
    }

    /// This type as a [`DType`].
    pub fn dtype(self) -> DType {
        match self {
            Half16::F16 => DType::F16,
            Half16::BF16 => DType::BF16,
        }
    }

    /// The value of the bit pattern `bits`, exactly, as f32.
    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            Half16::F16 => half::f16::from_bits(bits).to_f32(),
            Half16::BF16 => half::bf16::from_bits(bits).to_f32(),
        }
    }

    /// `v` rounded to this type, as its bit pattern.
    pub fn from_f32(self, v: f32) -> u16 {
        match self {
            Half16::F16 => half::f16::from_f32(v).to_bits(),
            Half16::BF16 => half::bf16::from_f32(v).to_bits(),
        }
    }

    /// Little-endian values of this type (`src`, two bytes each; a trailing
    /// odd byte is ignored) widened to f32.
    pub fn widen(self, src: &[u8]) -> impl Iterator<Item = f32> + '_ {
        src.chunks_exact(2)
            .map(move |c| self.to_f32(u16::from_le_bytes([c[0], c[1]])))
    }

    /// `src` narrowed into `dst` as little-endian values of this type, two
    /// bytes per value, until either runs out.
    pub fn narrow_into(self, src: impl IntoIterator<Item = f32>, dst: &mut [u8]) {
        for (v, out) in src.into_iter().zip(dst.chunks_exact_mut(2)) {
            out.copy_from_slice(&self.from_f32(v).to_le_bytes());
        }
    }
}

#[cfg(test)]
mod half16_tests {
    use super::*;

    #[test]
    fn widen_and_narrow_round_trip_every_finite_value() {
        for h in [Half16::F16, Half16::BF16] {
            assert_eq!(Half16::of(h.dtype()), Some(h));
            let bytes: Vec<u8> = (0..=u16::MAX)
                .filter(|&b| h.to_f32(b).is_finite())
                .flat_map(u16::to_le_bytes)
                .collect();
            let wide: Vec<f32> = h.widen(&bytes).collect();
            assert_eq!(wide.len(), bytes.len() / 2);
            let mut back = vec![0u8; bytes.len()];
            h.narrow_into(wide, &mut back);
            assert_eq!(back, bytes, "{h:?}");
        }
        assert_eq!(Half16::of(DType::F32), None);
        assert_eq!(
            Half16::BF16.from_f32(1.0 + 1.0 / 256.0),
            Half16::BF16.from_f32(1.0)
        );
    }
}
