//! A burn [`Module`]'s parameters as the training loop's [`Parameters`].

use accel::train::{ParamMut, ParamRef, Parameters};
use accel_api::{Error, Result};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};

use crate::host::{is_float, HostVec};

/// One float parameter of the module: its record path, burn id, shape and
/// the host buffers accel views.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) name: String,
    pub(crate) id: ParamId,
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
    /// The values (a copy of the module's tensor while `dirty` is false).
    pub(crate) value: HostVec,
    /// The gradient accel averages, clips and the optimizer reads.
    pub(crate) grad: HostVec,
}

/// The float parameters of a burn [`Module`], in the module's visiting
/// order, seen by accel's training loop as [`Parameters`].
///
/// # Names, shapes, dtypes
/// A parameter's name is its record path: the field names from the module
/// down, joined by `.` (`fc1.weight`, `layers.0.bias`), which is the key
/// burn's own stores (`burn-store`'s safetensors) read and write. Shapes
/// and element types (f32, f64, f16, bf16) are the tensors' own.
///
/// # Views and copies
/// burn tensors are immutable handles whose memory accel cannot borrow
/// mutably, so the model keeps a host copy of each parameter's values and
/// one gradient buffer per parameter:
/// * **gradients, burn to accel: 1 copy** per parameter and backward pass
///   ([`backward`](Self::backward) / [`add_grads`](Self::add_grads) add
///   burn's gradient into the buffer, which is also the accumulation);
///   accel averages, unscales and clips that buffer in place (0 copies);
/// * **values**: accel's writes to the views (the broadcast at
///   `prepare_model`, `load_state`, a [`BurnOptimizer`](crate::BurnOptimizer)
///   step) mark the module stale, and the next [`module`](Self::module)
///   call writes every parameter back into it (**1 copy accel to burn** per
///   optimizer step). [`bytes_copied`](Self::bytes_copied) counts both
///   directions; `tests/model.rs` checks them.
///
/// # ZeRO
/// [`set_param_storage`](Parameters::set_param_storage) and
/// [`release_grad`](Parameters::release_grad) free and restore the host
/// buffers; the module's own tensor stays (burn holds it), so stage 3
/// saves accel's copy only in this version.
///
/// # Requires
/// Every float parameter is initialized on a host device (the NdArray
/// backend, or any backend whose `to_data` reads it back); integer and
/// boolean parameters are not trained and not visited.
pub struct BurnModel<M: Module> {
    module: Option<M>,
    pub(crate) entries: Vec<Entry>,
    dirty: bool,
    bytes_copied: [u64; 2],
}

impl<M: Module> std::fmt::Debug for BurnModel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BurnModel")
            .field(
                "params",
                &self.entries.iter().map(|p| &p.name).collect::<Vec<_>>(),
            )
            .field("dirty", &self.dirty)
            .finish_non_exhaustive()
    }
}

/// The record path of the parameter being visited.
#[derive(Default)]
struct Path(Vec<String>);

impl Path {
    fn enter(&mut self, name: &str) {
        self.0.push(name.to_string());
    }
    fn exit(&mut self) {
        self.0.pop();
    }
    fn name(&self) -> String {
        self.0.join(".")
    }
}

struct Collect {
    path: Path,
    out: Vec<Result<Entry>>,
}

impl ModuleVisitor for Collect {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let name = self.path.name();
        let t = param.val();
        let dtype = t.dtype();
        let shape = t.shape().to_vec();
        let entry = if is_float(dtype) {
            HostVec::from_data(&t.to_data()).map(|value| Entry {
                grad: HostVec::zeros(dtype, value.len()),
                name,
                id: param.id,
                shape,
                dtype,
                value,
            })
        } else {
            Err(Error::invalid_argument(
                "BurnModel::new",
                format!("parameter {name:?} is {dtype:?}; accel-burn trains f32, f64, f16 and bf16 parameters"),
            ))
        };
        self.out.push(entry);
    }
}

/// Adds the gradients of the parameters under a module prefix.
struct AddGrads<'a> {
    grads: &'a GradientsParams,
    entries: &'a mut [Entry],
    prefix: Option<&'a str>,
    out: Result<u64>,
}

impl ModuleVisitor for AddGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.out.is_err() {
            return;
        }
        let Some(e) = self.entries.iter_mut().find(|e| e.id == param.id) else {
            return;
        };
        if let Some(prefix) = self.prefix {
            let under = e.name == prefix
                || (e.name.starts_with(prefix) && e.name[prefix.len()..].starts_with('.'));
            if !under {
                return;
            }
        }
        let Some(g) = self.grads.get::<D>(param.id) else {
            return;
        };
        let g = if g.dtype() == e.dtype {
            g
        } else {
            g.cast(e.dtype)
        };
        if e.grad.len() == 0 {
            // Freed by ZeRO stage 2: back zero-filled, as autograd allocates.
            e.grad = HostVec::zeros(e.dtype, e.value.len().max(e.shape.iter().product()));
        }
        let data = g.into_data();
        let r = e.grad.add_data(&e.name, &data);
        self.out = match (std::mem::replace(&mut self.out, Ok(0)), r) {
            (Ok(n), Ok(())) => Ok(n + data.as_bytes().len() as u64),
            (_, Err(err)) | (Err(err), _) => Err(err),
        };
    }
}

/// Writes the host values back into the module's tensors.
struct Push<'a> {
    entries: &'a [Entry],
    bytes: u64,
}

impl ModuleMapper for Push<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(e) = self.entries.iter().find(|e| e.id == param.id) else {
            return param;
        };
        if e.value.len() == 0 {
            // Released by ZeRO stage 3: burn keeps its tensor.
            return param;
        }
        let data = e.value.to_data(&e.shape);
        self.bytes += data.as_bytes().len() as u64;
        param.map(|t| {
            let require_grad = t.is_require_grad();
            // In the parameter's own dtype (burn would convert to the
            // device's default float type otherwise).
            let fresh = Tensor::<D>::from_data(data, (&t.device(), t.dtype()));
            if require_grad {
                fresh.require_grad()
            } else {
                fresh
            }
        })
    }
}

impl<M: Module> BurnModel<M> {
    /// Adopt `module`'s float parameters (initialized here if lazy).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// naming the parameter when one is not f32, f64, f16 or bf16, when
    /// two share a path, or when the module has no float parameter;
    /// [`ErrorKind::Backend`](accel_api::ErrorKind::Backend) when burn
    /// cannot read one back.
    pub fn new(module: M) -> Result<BurnModel<M>> {
        let mut c = Collect {
            path: Path::default(),
            out: Vec::new(),
        };
        module.visit(&mut c);
        let entries = c.out.into_iter().collect::<Result<Vec<_>>>()?;
        if entries.is_empty() {
            return Err(Error::invalid_argument(
                "BurnModel::new",
                "the module has no float parameter",
            ));
        }
        let mut names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::invalid_argument(
                "BurnModel::new",
                format!("two parameters have the record path {:?}", w[0]),
            ));
        }
        Ok(BurnModel {
            module: Some(module),
            entries,
            dirty: false,
            bytes_copied: [0; 2],
        })
    }

    fn sync(&mut self) {
        if !self.dirty {
            return;
        }
        let module = self
            .module
            .take()
            .expect("the module is present between calls");
        let mut push = Push {
            entries: &self.entries,
            bytes: 0,
        };
        let module = module.map(&mut push);
        self.bytes_copied[1] += push.bytes;
        self.module = Some(module);
        self.dirty = false;
    }

    /// The module, with the values accel last wrote (written back into
    /// its tensors here when accel changed them: one copy per parameter).
    /// Run the forward pass on it.
    pub fn module(&mut self) -> &M {
        self.sync();
        self.module
            .as_ref()
            .expect("the module is present between calls")
    }

    /// The module, given back with accel's latest values.
    pub fn into_module(mut self) -> M {
        self.sync();
        self.module
            .take()
            .expect("the module is present between calls")
    }

    /// Replace the module by one of the same structure (same parameter
    /// ids, as burn's `load_record` or a mapping gives), and take its
    /// values as accel's (one copy out of burn per parameter).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// when its parameters are not this model's (paths, shapes, dtypes).
    pub fn set_module(&mut self, module: M) -> Result<()> {
        let fresh = BurnModel::new(module)?;
        let same = fresh.entries.len() == self.entries.len()
            && fresh
                .entries
                .iter()
                .zip(&self.entries)
                .all(|(a, b)| a.name == b.name && a.shape == b.shape && a.dtype == b.dtype);
        if !same {
            return Err(Error::invalid_argument(
                "BurnModel::set_module",
                "the module's parameters are not this model's (record paths, shapes, dtypes)",
            ));
        }
        for (e, f) in self.entries.iter_mut().zip(fresh.entries) {
            self.bytes_copied[0] += (f.value.len() * f.dtype.size()) as u64;
            e.id = f.id;
            e.value = f.value;
        }
        self.module = fresh.module;
        self.dirty = false;
        Ok(())
    }

    /// Run burn's backward pass on `loss` (already multiplied by the scale
    /// [`Accelerator::backward`](accel::Accelerator::backward) gives the
    /// closure) and add the gradients into the buffers.
    ///
    /// # Errors
    /// As [`add_grads`](Self::add_grads).
    pub fn backward(&mut self, loss: Tensor<1>) -> Result<()> {
        let grads = loss.backward();
        let module = self
            .module
            .as_ref()
            .expect("the module is present between calls");
        let grads = GradientsParams::from_grads(grads, module);
        self.add_grads(&grads)
    }

    /// Add `grads` (burn's gradients of this module) into the buffers;
    /// parameters without a gradient keep theirs.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// naming the parameter when its gradient has another length.
    pub fn add_grads(&mut self, grads: &GradientsParams) -> Result<()> {
        self.add_grads_under(grads, None)
    }

    /// [`add_grads`](Self::add_grads) for the parameters of submodule
    /// `module` only (those whose path is `module` or starts with
    /// `module.`): a ZeRO gate's module-by-module backward adds each
    /// module's gradients after gathering it.
    ///
    /// # Errors
    /// As [`add_grads`](Self::add_grads).
    pub fn add_module_grads(&mut self, grads: &GradientsParams, module: &str) -> Result<()> {
        self.add_grads_under(grads, Some(module))
    }

    fn add_grads_under(&mut self, grads: &GradientsParams, prefix: Option<&str>) -> Result<()> {
        let module = self
            .module
            .as_ref()
            .expect("the module is present between calls");
        let mut v = AddGrads {
            grads,
            entries: &mut self.entries,
            prefix,
            out: Ok(0),
        };
        module.visit(&mut v);
        self.bytes_copied[0] += v.out?;
        Ok(())
    }

    /// Give every parameter seeded values, in record-path order: uniform
    /// in `±1/sqrt(fan_in)`, where `fan_in` is the product of a
    /// parameter's dimensions but the last (burn's `Linear` stores its
    /// weight (in, out)) and its length for a 1-D one. burn's own
    /// initialisers draw from an unseeded generator; call this for runs
    /// that must start equal (a run and its resumed twin). The module gets
    /// the values at the next [`module`](Self::module) call.
    pub fn init_uniform(&mut self, seed: u64) {
        let mut order: Vec<usize> = (0..self.entries.len()).collect();
        order.sort_by(|&a, &b| self.entries[a].name.cmp(&self.entries[b].name));
        let mut rng = accel::train::Rng::seed_from_u64(seed);
        for i in order {
            let e = &mut self.entries[i];
            let fan_in: usize = match e.shape.split_last() {
                Some((_, rest)) if !rest.is_empty() => rest.iter().product(),
                _ => e.shape.iter().product(),
            };
            let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
            let values: Vec<f32> = (0..e.shape.iter().product::<usize>())
                .map(|_| (2.0 * rng.uniform() - 1.0) * bound)
                .collect();
            e.value = HostVec::from_f32(e.dtype, &values);
        }
        self.dirty = true;
    }

    /// The parameters' record paths, in the training loop's order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.name.as_str())
    }

    /// The burn element type of parameter `name`.
    pub fn param_dtype(&self, name: &str) -> Option<DType> {
        self.entries
            .iter()
            .find(|e| e.name == name)
            .map(|e| e.dtype)
    }

    /// Bytes copied so far: `[burn to accel, accel to burn]` (gradients
    /// added, values taken from a new module; values written back).
    pub fn bytes_copied(&self) -> [u64; 2] {
        self.bytes_copied
    }

    fn index(&self, op: &str, name: &str) -> Result<usize> {
        self.entries
            .iter()
            .position(|e| e.name == name)
            .ok_or_else(|| {
                Error::invalid_argument(op, format!("the model has no parameter {name:?}"))
            })
    }
}

impl<M: Module> Parameters for BurnModel<M> {
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        for e in &self.entries {
            f(ParamRef {
                name: &e.name,
                value: e.value.buf(),
                grad: e.grad.buf(),
            });
        }
    }

    /// Marks the module stale: [`BurnModel::module`] writes the values
    /// back before the next forward pass.
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        self.dirty = true;
        for e in &mut self.entries {
            f(ParamMut {
                name: &e.name,
                value: e.value.buf_mut(),
                grad: e.grad.buf_mut(),
            });
        }
    }

    fn num_params(&self) -> usize {
        self.entries
            .iter()
            .map(|e| e.shape.iter().product::<usize>())
            .sum()
    }

    fn param_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.entries
            .iter()
            .find(|e| e.name == name)
            .map(|e| e.shape.clone())
    }

    /// `numel == 0` frees accel's copies of the values and the gradient
    /// (ZeRO stage 3 released the unit; burn keeps its tensor); otherwise
    /// `numel` is the parameter's element count and both come back
    /// zero-filled, for the gather to fill.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// for a name the model does not have or another element count.
    fn set_param_storage(&mut self, name: &str, numel: usize) -> Result<()> {
        let i = self.index("set_param_storage", name)?;
        let e = &mut self.entries[i];
        let n: usize = e.shape.iter().product();
        if numel != 0 && numel != n {
            return Err(Error::invalid_argument(
                "set_param_storage",
                format!(
                    "parameter {name:?} of shape {:?} cannot hold {numel} elements",
                    e.shape
                ),
            ));
        }
        e.value.resize(numel);
        e.grad.resize(numel);
        Ok(())
    }

    /// Free the gradient buffer of `name` (ZeRO stage 2); the next
    /// [`add_grads`](BurnModel::add_grads) gives it back zero-filled.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// for a name the model does not have.
    fn release_grad(&mut self, name: &str) -> Result<()> {
        let i = self.index("release_grad", name)?;
        self.entries[i].grad.resize(0);
        Ok(())
    }
}
