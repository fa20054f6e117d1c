//! Fixtures shared by the training-loop tests: a linear model with
//! hand-derived gradients, a deterministic dataset, and accelerators on one
//! process or on threads as ranks.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use accel::train::*;
use accel::{Accelerator, ConnectContext, ProcessState, Registry, Store};

// ------------------------------------------------------------------ fixtures

/// `y ≈ w·x + b` with the mean squared error and hand-derived gradients.
#[derive(Clone, Debug, PartialEq)]
pub struct Linear {
    pub w: Vec<f32>,
    pub b: Vec<f32>,
    pub gw: Vec<f32>,
    pub gb: Vec<f32>,
}

impl Linear {
    pub fn new(d: usize) -> Linear {
        Linear {
            w: (0..d).map(|i| 0.1 * i as f32 - 0.2).collect(),
            b: vec![0.05],
            gw: vec![0.0; d],
            gb: vec![0.0],
        }
    }
    pub fn grad(&mut self, batch: &[(Vec<f32>, f32)], scale: f32) -> f32 {
        let n = batch.len() as f32;
        let mut loss = 0.0;
        for (x, y) in batch {
            let p: f32 = self.b[0] + x.iter().zip(&self.w).map(|(a, b)| a * b).sum::<f32>();
            let e = p - y;
            loss += e * e / n;
            let d = scale * 2.0 * e / n;
            self.gb[0] += d;
            for (g, v) in self.gw.iter_mut().zip(x) {
                *g += d * v;
            }
        }
        loss
    }
    pub fn flat(&self) -> Vec<f32> {
        [self.w.clone(), self.b.clone()].concat()
    }
}

/// [`Parameters`] for a struct of host vectors: `name: value, gradient;`
/// per parameter, in visiting order.
#[allow(unused_macros)]
macro_rules! host_parameters {
    ($T:ty { $($name:literal: $v:ident, $g:ident;)+ }) => {
        impl Parameters for $T {
            fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
                $(f(ParamRef::host($name, &self.$v, &self.$g));)+
            }
            fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
                $(f(ParamMut::host($name, &mut self.$v, &mut self.$g));)+
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use host_parameters;

host_parameters!(Linear { "w": w, gw; "b": b, gb; });

#[derive(Clone, Copy, Debug)]
pub struct Data {
    pub len: usize,
    pub d: usize,
}

impl Dataset for Data {
    type Item = (Vec<f32>, f32);
    fn len(&self) -> usize {
        self.len
    }
    fn get(&self, i: usize) -> (Vec<f32>, f32) {
        let x: Vec<f32> = (0..self.d)
            .map(|j| (((i * 31 + j * 17) % 23) as f32 / 23.0) - 0.5)
            .collect();
        let y = x.iter().enumerate().map(|(j, v)| v * j as f32).sum::<f32>() + 0.3;
        (x, y)
    }
}

pub fn single() -> Accelerator {
    let state = Arc::new(ProcessState::from_vars(HashMap::new()).unwrap());
    Accelerator::connect(state, &Registry::builtin()).unwrap()
}

/// Run `f(accelerator)` on `world` threads connected by cpu-gloo through
/// one in-memory store; results in rank order. Fails the test after 60 s.
pub fn ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(Accelerator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let registry = Registry::builtin();
    let backend = registry
        .get("cpu-gloo")
        .expect("cpu-gloo is compiled in")
        .backend
        .clone();
    let store: Arc<dyn Store> = Arc::new(accel::rendezvous::MemoryStore::new());
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for rank in 0..world {
        let (backend, store, f, tx) = (backend.clone(), store.clone(), f.clone(), tx.clone());
        std::thread::spawn(move || {
            let comm = backend
                .connect(
                    ConnectContext::local(rank, world, Duration::from_secs(20), store.clone())
                        .with_run_id("train-test"),
                )
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            let acc = Accelerator::from_communicator(Arc::from(comm), store).unwrap();
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(acc)));
            let _ = tx.send((rank, out));
        });
    }
    drop(tx);
    let mut out: Vec<Option<T>> = (0..world).map(|_| None).collect();
    for _ in 0..world {
        let (rank, r) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("a rank did not finish within 60 s");
        match r {
            Ok(v) => out[rank] = Some(v),
            Err(p) => std::panic::resume_unwind(p),
        }
    }
    out.into_iter().map(Option::unwrap).collect()
}

use accel_test_support::python;
#[allow(unused_imports)]
pub use python::{python_from, run_python, run_python_file, torch_python_candidates};
