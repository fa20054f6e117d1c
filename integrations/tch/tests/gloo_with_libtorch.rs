//! One binary linking libtorch (through tch) and the cpu-gloo backend, with
//! libtorch ahead of every other library in its load order (this test
//! checks that from its own ELF header) and no link-order workaround: a
//! 2-rank all-reduce of tensors over cpu-gloo must work. libtorch_cpu.so
//! exports its own copy of Gloo; unless cpu-gloo binds its Gloo privately,
//! its calls land in libtorch's copy (another version and ABI) and crash.

use std::sync::{mpsc, Arc};
use std::time::Duration;

use accel::{Accelerator, ConnectContext, ReduceOp, Registry, Store};
use accel_tch::TensorCollectives;
use tch::{Device, Kind, Tensor};

/// The libraries this executable names in its dynamic section, in order.
fn needed() -> Vec<String> {
    let exe = std::env::current_exe().expect("current_exe");
    let out = std::process::Command::new("readelf")
        .arg("-d")
        .arg(&exe)
        .output()
        .expect("readelf (binutils) runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| {
            l.split('[')
                .nth(1)
                .map(|s| s.trim_end_matches(']').to_string())
        })
        .collect()
}

#[test]
fn two_ranks_all_reduce_over_cpu_gloo_with_libtorch_loaded_first() {
    let libs = needed();
    let torch = libs.iter().position(|l| l.starts_with("libtorch_cpu"));
    let gloo = libs.iter().position(|l| l.starts_with("libgloo"));
    assert!(torch.is_some(), "libtorch_cpu is linked: {libs:?}");
    // cpu-gloo opens its Gloo privately at run time: the binary names no
    // libgloo, so libtorch's copy is the only Gloo loaded at start.
    assert!(
        gloo.is_none(),
        "no libgloo in the binary's load order: {libs:?}"
    );
    // libtorch is initialised before Gloo is touched.
    let _ = Tensor::ones([1], (Kind::Float, Device::Cpu)).sum(Kind::Float);

    let backend = Registry::builtin()
        .get("cpu-gloo")
        .expect("cpu-gloo is compiled in")
        .backend
        .clone();
    let store: Arc<dyn Store> = Arc::new(accel::rendezvous::MemoryStore::new());
    let (tx, rx) = mpsc::channel();
    for rank in 0..2 {
        let (backend, store, tx) = (backend.clone(), store.clone(), tx.clone());
        std::thread::spawn(move || {
            let out = (|| -> accel::Result<Vec<f32>> {
                let comm = backend.connect(
                    ConnectContext::local(rank, 2, Duration::from_secs(20), store.clone())
                        .with_run_id("gloo-with-libtorch"),
                )?;
                let acc = Accelerator::from_communicator(Arc::from(comm), store)?;
                let mut t = Tensor::from_slice(&[1.0f32, 2.0, 3.0]) * (rank as f64 + 1.0);
                acc.all_reduce_tensor(&mut t, ReduceOp::Sum)?;
                Ok(Vec::<f32>::try_from(&t).expect("f32 tensor"))
            })();
            let _ = tx.send((rank, out));
        });
    }
    drop(tx);
    for _ in 0..2 {
        let (rank, out) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("a rank finished within 60 s");
        assert_eq!(
            out.unwrap_or_else(|e| panic!("rank {rank}: {e}")),
            vec![3.0, 6.0, 9.0]
        );
    }
}
