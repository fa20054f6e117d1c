//! accel-offload's own safetensors codec (header-only reads for the
//! planner, docs/adr/0022-safetensors-codec.md) against the
//! `safetensors` crate: each reads what the other writes, byte for byte.

use accel_api::{DType, TensorMeta};
use accel_offload::safetensors::{read_header, write_file, SafetensorsFile};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

/// (name, accel dtype, crate dtype, shape): every dtype both sides carry.
fn specs() -> Vec<(&'static str, DType, Dtype, Vec<usize>)> {
    vec![
        ("embed.weight", DType::BF16, Dtype::BF16, vec![4, 3]),
        ("layers.0.w", DType::F16, Dtype::F16, vec![2, 5]),
        ("layers.0.b", DType::F32, Dtype::F32, vec![5]),
        ("head.scale", DType::F64, Dtype::F64, vec![]),
        ("ids", DType::I64, Dtype::I64, vec![3]),
        ("idx32", DType::I32, Dtype::I32, vec![2, 2]),
        ("mask", DType::U8, Dtype::U8, vec![7]),
        ("q", DType::I8, Dtype::I8, vec![1, 1, 6]),
    ]
}

fn bytes_for(i: usize, meta: &TensorMeta) -> Vec<u8> {
    (0..meta.byte_len())
        .map(|k| (k * 31 + i * 7) as u8)
        .collect()
}

#[test]
fn the_crate_reads_what_offload_writes() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("ours.safetensors");
    let metas: Vec<TensorMeta> = specs()
        .iter()
        .map(|(_, dt, _, shape)| TensorMeta {
            dtype: *dt,
            shape: shape.clone(),
        })
        .collect();
    let data: Vec<Vec<u8>> = metas
        .iter()
        .enumerate()
        .map(|(i, m)| bytes_for(i, m))
        .collect();
    let specs = specs();
    write_file(
        &path,
        specs
            .iter()
            .zip(&metas)
            .zip(&data)
            .map(|(((n, ..), m), b)| (*n, m, b.as_slice())),
    )
    .unwrap();
    let file = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&file).unwrap();
    assert_eq!(st.len(), specs.len());
    for (i, (name, _, dtype, shape)) in specs.iter().enumerate() {
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), *dtype, "{name}");
        assert_eq!(t.shape(), shape.as_slice(), "{name}");
        assert_eq!(t.data(), data[i].as_slice(), "{name}");
    }
}

#[test]
fn offload_reads_what_the_crate_writes() {
    let specs = specs();
    let data: Vec<Vec<u8>> = specs
        .iter()
        .enumerate()
        .map(|(i, (_, dt, _, shape))| {
            let meta = TensorMeta {
                dtype: *dt,
                shape: shape.clone(),
            };
            bytes_for(i, &meta)
        })
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = specs
        .iter()
        .zip(&data)
        .map(|((n, _, dt, shape), b)| (*n, TensorView::new(*dt, shape.clone(), b).unwrap()))
        .collect();
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("theirs.safetensors");
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();

    let header = read_header(&path).unwrap();
    let file = SafetensorsFile::open(&path).unwrap();
    assert_eq!(header.len(), specs.len());
    assert_eq!(file.entries(), header.as_slice());
    for (i, (name, dt, _, shape)) in specs.iter().enumerate() {
        let (e, bytes) = file.tensor(name).unwrap();
        assert_eq!(e.meta.dtype, *dt, "{name}");
        assert_eq!(e.meta.shape, *shape, "{name}");
        assert_eq!(bytes, data[i].as_slice(), "{name}");
    }
}
