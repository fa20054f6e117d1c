//! The JSON forms of a layout: the documents written and read
//! ([`LayoutJson`], [`ModuleJson`], [`TensorJson`]) and the borrowed forms
//! the serde path reads them into.

use std::borrow::Cow;

use accel_api::DType;
use serde::{Deserialize, Serialize};

/// A tensor to push: element type, shape, persistence.
pub(super) struct TensorIn<'s> {
    pub(super) dtype: DType,
    pub(super) shape: &'s [usize],
    pub(super) persistent: bool,
}

/// JSON form of one tensor.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TensorJson {
    /// Local name.
    pub name: String,
    /// Element type.
    #[serde(with = "dtype_serde")]
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// `false` for a non-persistent buffer (absent from checkpoints);
    /// written only when `false`.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub persistent: bool,
}

pub(super) fn yes() -> bool {
    true
}

pub(super) fn is_true(b: &bool) -> bool {
    *b
}

/// JSON form of one module.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct ModuleJson {
    /// Local name (`""` for the root).
    #[serde(default)]
    pub name: String,
    /// Class name, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// Own parameters in definition order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub params: Vec<TensorJson>,
    /// Own buffers in definition order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub buffers: Vec<TensorJson>,
    /// Child modules in definition order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<ModuleJson>,
}

/// JSON form of a whole layout.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayoutJson {
    /// Always `accel-layout/1`.
    pub format: String,
    /// The root module.
    pub root: ModuleJson,
    /// Tied groups of full tensor names.
    #[serde(default)]
    pub tied: Vec<Vec<String>>,
}

/// The format tag written and accepted.
pub const LAYOUT_FORMAT: &str = "accel-layout/1";

/// A string borrowed from the JSON text when it has no escapes.
#[derive(Default)]
pub(super) struct Str<'a>(pub(super) Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// A dtype read without allocating.
pub(super) struct RawDType(pub(super) DType);

impl<'de> Deserialize<'de> for RawDType {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = RawDType;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a dtype name")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RawDType, E> {
                // The canonical names without allocating; anything else
                // (torch spellings) through `DType::from_str`.
                if let Some(&d) = DType::ALL.iter().find(|d| d.name() == v) {
                    return Ok(RawDType(d));
                }
                v.strip_prefix("torch.")
                    .unwrap_or(v)
                    .parse::<DType>()
                    .map(RawDType)
                    .map_err(|e| E::custom(e.to_string()))
            }
        }
        d.deserialize_str(V)
    }
}

/// The parsing form of [`LayoutJson`]: names borrowed from the text, shapes
/// moved into the layout (the fast path of [`Layout::from_json_file`]).
#[derive(Deserialize)]
pub(super) struct RawDoc<'a> {
    #[serde(borrow)]
    pub(super) format: Str<'a>,
    #[serde(borrow)]
    pub(super) root: RawModule<'a>,
    #[serde(default)]
    pub(super) tied: Vec<Vec<String>>,
}

#[derive(Deserialize, Default)]
pub(super) struct RawModule<'a> {
    #[serde(default, borrow)]
    pub(super) name: Str<'a>,
    #[serde(default, borrow)]
    pub(super) class: Option<Str<'a>>,
    #[serde(default, borrow)]
    pub(super) params: Vec<RawTensor<'a>>,
    #[serde(default, borrow)]
    pub(super) buffers: Vec<RawTensor<'a>>,
    #[serde(default, borrow)]
    pub(super) children: Vec<RawModule<'a>>,
}

#[derive(Deserialize)]
pub(super) struct RawTensor<'a> {
    #[serde(borrow)]
    pub(super) name: Str<'a>,
    pub(super) dtype: RawDType,
    pub(super) shape: Vec<usize>,
    #[serde(default = "yes")]
    pub(super) persistent: bool,
}

impl RawTensor<'_> {
    pub(super) fn input(&self) -> TensorIn<'_> {
        TensorIn {
            dtype: self.dtype.0,
            shape: &self.shape,
            persistent: self.persistent,
        }
    }
}

impl<'a> RawModule<'a> {
    /// A borrowed view of a [`ModuleJson`] (shapes copied).
    pub(super) fn of(m: &'a ModuleJson) -> RawModule<'a> {
        let t = |t: &'a TensorJson| RawTensor {
            name: Str(Cow::Borrowed(&t.name)),
            dtype: RawDType(t.dtype),
            shape: t.shape.clone(),
            persistent: t.persistent,
        };
        RawModule {
            name: Str(Cow::Borrowed(&m.name)),
            class: m.class.as_deref().map(|c| Str(Cow::Borrowed(c))),
            params: m.params.iter().map(t).collect(),
            buffers: m.buffers.iter().map(t).collect(),
            children: m.children.iter().map(RawModule::of).collect(),
        }
    }
}

pub(super) mod dtype_serde {
    use accel_api::DType;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(d.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        let s = String::deserialize(d)?;
        let t = s.trim_start_matches("torch.");
        t.parse::<DType>()
            .map_err(|e| serde::de::Error::custom(e.to_string()))
    }
}
