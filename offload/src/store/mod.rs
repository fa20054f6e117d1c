//! Offload stores implementing [`accel_api::OffloadStore`].
//!
//! | store | medium | `get` |
//! |---|---|---|
//! | [`HostStore`] | host RAM | borrowed, zero-copy |
//! | [`DiskStore`] | safetensors files, memory-mapped | borrowed from the mapping |
//! | [`AccelerateFolder`] | Accelerate's offload folder (`index.json` + `<name>.dat`) | borrowed from the mapping |
//!
//! Replacing a tensor with `put` is atomic; the old bytes stay valid (and
//! allocated) until the store is dropped, because earlier `get`s may still
//! borrow them.

mod accelerate;
mod disk;
mod host;

pub use accelerate::AccelerateFolder;
pub use disk::DiskStore;
pub use host::HostStore;

use accel_api::{Error, ErrorKind, TensorMeta};

pub(crate) fn missing(store: &str, name: &str) -> Error {
    Error::new(
        ErrorKind::InvalidArgument,
        format!("{store}: no tensor `{name}`"),
    )
}

pub(crate) fn check_len(
    store: &str,
    name: &str,
    meta: &TensorMeta,
    data: &[u8],
) -> accel_api::Result<()> {
    let need = meta.checked_byte_len();
    if need != Some(data.len()) {
        let need = need.map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string());
        return Err(Error::invalid_argument(
            format!("{store} put"),
            format!(
                "tensor `{name}`: {} bytes given but {} {:?} needs {need}",
                data.len(),
                meta.dtype,
                meta.shape,
            ),
        ));
    }
    Ok(())
}

/// Tensor names become file names: ASCII letters, digits, `.`, `_`, `-`
/// are kept, every other byte is written `%XX`.
pub(crate) fn file_stem(name: &str) -> String {
    let mut s = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-' {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    if s.starts_with('.') {
        s.replace_range(0..1, "%2E");
    }
    s
}

#[cfg(test)]
pub(crate) mod conformance {
    //! Behaviour every store shares.
    use accel_api::{DType, ErrorKind, OffloadStore, TensorMeta};

    pub fn check(store: &dyn OffloadStore) {
        let m = TensorMeta {
            dtype: DType::F32,
            shape: vec![2, 2],
        };
        let a: Vec<u8> = (0..16).collect();
        store.put("layers.0.w", m.clone(), &a).unwrap();
        store
            .put(
                "layers.odd name+%",
                TensorMeta {
                    dtype: DType::U8,
                    shape: vec![],
                },
                &[9],
            )
            .unwrap();
        assert!(store.contains("layers.0.w"));
        assert_eq!(store.get("layers.0.w").unwrap().as_ref(), &a[..]);
        assert_eq!(store.meta("layers.0.w").unwrap(), m);
        assert_eq!(store.get("layers.odd name+%").unwrap().as_ref(), &[9]);
        assert_eq!(
            store.keys(),
            vec!["layers.0.w".to_string(), "layers.odd name+%".to_string()]
        );
        // A borrow survives a replacement; the new value is seen afterwards.
        let before = store.get("layers.0.w").unwrap();
        let b: Vec<u8> = (100..116).collect();
        store.put("layers.0.w", m.clone(), &b).unwrap();
        assert_eq!(before.as_ref(), &a[..]);
        assert_eq!(store.get("layers.0.w").unwrap().as_ref(), &b[..]);
        // Errors.
        let e = store.get("nope").unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("nope"), "{e}");
        assert_eq!(
            store.meta("nope").unwrap_err().kind(),
            &ErrorKind::InvalidArgument
        );
        let e = store.put("x", m, &[1, 2, 3]).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
        assert!(!store.contains("x"));
    }
}
