//! A multi-layer perceptron with hand-derived gradients, written unit by
//! unit for ZeRO stage 3: every layer `fcN` is one module the model gathers
//! before its forward and its backward, releases after its forward and
//! reduces after its backward, through a [`UnitGate`].

use accel::train::{ParamMut, ParamRef, Parameters};
use accel::zero::{resize_host_storage, UnitGate};
use accel::{Error, Result};

/// SplitMix64's finaliser: a fixed hash, so weights and data are the same
/// on every rank and every run.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A value in `[-1, 1)` from `(a, b)`.
pub fn uniform(a: u64, b: u64) -> f32 {
    let h = mix(mix(a) ^ b.wrapping_mul(0x1000_0000_01b3));
    ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// `in → h1 → … → out`, ReLU between layers, mean squared error. Layer
/// `l` (from 1) has parameters `fc{l}.weight` (`out × in`, row-major) and
/// `fc{l}.bias`, visited in that order, layer after layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Deep {
    widths: Vec<usize>,
    modules: Vec<String>,
    names: Vec<String>,
    /// Per parameter (weight, bias, weight, ...): values.
    values: Vec<Vec<f32>>,
    /// Per parameter: gradients.
    grads: Vec<Vec<f32>>,
}

impl Deep {
    /// A model of the given widths (`[in, hidden..., out]`, at least two)
    /// with deterministic weights scaled by `1/sqrt(in)` and small biases.
    ///
    /// # Errors
    /// [`accel::ErrorKind::InvalidArgument`] for fewer than two widths or
    /// a width of 0.
    pub fn new(widths: &[usize]) -> Result<Deep> {
        if widths.len() < 2 || widths.contains(&0) {
            return Err(Error::invalid_argument(
                "zero-bench model",
                format!("widths {widths:?}: need at least an input and an output width, none 0"),
            ));
        }
        let layers = widths.len() - 1;
        let mut m = Deep {
            widths: widths.to_vec(),
            modules: (1..=layers).map(|l| format!("fc{l}")).collect(),
            names: Vec::new(),
            values: Vec::new(),
            grads: Vec::new(),
        };
        for l in 0..layers {
            let (din, dout) = (widths[l], widths[l + 1]);
            let scale = 1.0 / (din as f32).sqrt();
            let w = (0..din * dout)
                .map(|i| uniform(l as u64 + 1, i as u64) * scale)
                .collect();
            m.names.push(format!("fc{}.weight", l + 1));
            m.names.push(format!("fc{}.bias", l + 1));
            m.values.push(w);
            // Biases off 0, so no ReLU sits exactly at its kink.
            m.values.push(
                (0..dout)
                    .map(|o| 0.1 * uniform(100 + l as u64, o as u64))
                    .collect(),
            );
        }
        m.grads = m.values.iter().map(|v| vec![0.0; v.len()]).collect();
        Ok(m)
    }

    /// The layer widths.
    pub fn widths(&self) -> &[usize] {
        &self.widths
    }

    /// Parameter elements (full model).
    pub fn numel(&self) -> usize {
        (0..self.widths.len() - 1)
            .map(|l| (self.widths[l] + 1) * self.widths[l + 1])
            .sum()
    }

    /// Elements of parameter values the model holds now.
    pub fn resident_values(&self) -> usize {
        self.values.iter().map(Vec::len).sum()
    }

    /// Elements of gradients the model holds now.
    pub fn resident_grads(&self) -> usize {
        self.grads.iter().map(Vec::len).sum()
    }

    /// Fill every gradient the model holds with 0.
    pub fn zero_grad(&mut self) {
        self.grads.iter_mut().for_each(|g| g.fill(0.0));
    }

    /// Mean squared error of `batch` inputs `x` (`batch × in`) against
    /// targets `y` (`batch × out`); adds `scale ×` its gradient to the
    /// gradient buffers, layer by layer through `gate` (stage 3 gathers,
    /// releases and reduce-scatters; other gates do nothing). Returns the
    /// unscaled loss.
    ///
    /// # Errors
    /// [`accel::ErrorKind::InvalidArgument`] when `x` or `y` has the wrong
    /// length or a layer's values are missing (not gathered); the gate's.
    pub fn loss_and_grad_units(
        &mut self,
        x: &[f32],
        y: &[f32],
        batch: usize,
        scale: f32,
        gate: &mut dyn UnitGate,
    ) -> Result<f32> {
        let layers = self.widths.len() - 1;
        let (din0, dout_last) = (self.widths[0], self.widths[layers]);
        if x.len() != batch * din0 || y.len() != batch * dout_last {
            return Err(Error::invalid_argument(
                "zero-bench model",
                format!(
                    "a batch of {batch} needs {} inputs and {} targets; got {} and {}",
                    batch * din0,
                    batch * dout_last,
                    x.len(),
                    y.len()
                ),
            ));
        }
        let mut acts: Vec<Vec<f32>> = vec![x.to_vec()];
        for l in 0..layers {
            let module = self.modules[l].clone();
            gate.gather(self, &module)?;
            let (din, dout) = (self.widths[l], self.widths[l + 1]);
            let (w, b) = self.layer(l)?;
            let a = &acts[l];
            let mut out = vec![0.0f32; batch * dout];
            for s in 0..batch {
                let xs = &a[s * din..(s + 1) * din];
                for o in 0..dout {
                    let z = b[o] + dot(&w[o * din..(o + 1) * din], xs);
                    out[s * dout + o] = if l + 1 < layers { z.max(0.0) } else { z };
                }
            }
            acts.push(out);
            // The last layer's backward comes next: keep it.
            if l + 1 < layers {
                gate.release(self, &module)?;
            }
        }
        let pred = &acts[layers];
        let n = batch.max(1) as f32;
        let mut loss = 0.0;
        let mut delta: Vec<f32> = pred
            .iter()
            .zip(y)
            .map(|(p, t)| {
                let e = p - t;
                loss += e * e / n;
                scale * 2.0 * e / n
            })
            .collect();
        for l in (0..layers).rev() {
            let module = self.modules[l].clone();
            gate.gather(self, &module)?;
            let (din, dout) = (self.widths[l], self.widths[l + 1]);
            self.layer(l)?;
            // Gradients a ZeRO-2 gate freed come back as the backward
            // writes them (as autograd allocates `.grad`).
            for i in [2 * l, 2 * l + 1] {
                let n = self.values[i].len();
                resize_host_storage(&mut self.grads[i], n);
            }
            let a = &acts[l];
            {
                let (gw, rest) = self.grads[2 * l..2 * l + 2].split_at_mut(1);
                let (gw, gb) = (&mut gw[0], &mut rest[0]);
                for s in 0..batch {
                    let xs = &a[s * din..(s + 1) * din];
                    for o in 0..dout {
                        let d = delta[s * dout + o];
                        gb[o] += d;
                        if d != 0.0 {
                            axpy(&mut gw[o * din..(o + 1) * din], d, xs);
                        }
                    }
                }
            }
            let prev = if l > 0 {
                let w = &self.values[2 * l];
                let mut prev = vec![0.0f32; batch * din];
                for s in 0..batch {
                    let ps = &mut prev[s * din..(s + 1) * din];
                    for o in 0..dout {
                        let d = delta[s * dout + o];
                        if d != 0.0 {
                            axpy(ps, d, &w[o * din..(o + 1) * din]);
                        }
                    }
                    // ReLU: no gradient where the activation was 0.
                    for (p, act) in ps.iter_mut().zip(&a[s * din..(s + 1) * din]) {
                        if *act <= 0.0 {
                            *p = 0.0;
                        }
                    }
                }
                prev
            } else {
                Vec::new()
            };
            gate.reduce_grads(self, &module)?;
            delta = prev;
        }
        Ok(loss)
    }

    /// Layer `l`'s weight and bias, checked present.
    fn index_of(&self, name: &str) -> Result<usize> {
        self.names.iter().position(|n| n == name).ok_or_else(|| {
            Error::invalid_argument("set_param_storage", format!("no parameter {name:?}"))
        })
    }

    fn layer(&self, l: usize) -> Result<(&[f32], &[f32])> {
        let (din, dout) = (self.widths[l], self.widths[l + 1]);
        let (w, b) = (&self.values[2 * l], &self.values[2 * l + 1]);
        if w.len() != din * dout || b.len() != dout {
            return Err(Error::invalid_argument(
                "zero-bench model",
                format!("layer {} is not present", self.modules[l]),
            )
            .with_fix("gather the unit before using it"));
        }
        Ok((w, b))
    }
}

/// `a · b` with eight partial sums, so the compiler can vectorise it.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = (ca.remainder().iter())
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += a x`.
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

impl Parameters for Deep {
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        for ((name, v), g) in self.names.iter().zip(&self.values).zip(&self.grads) {
            f(ParamRef::host(name, v, g));
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        let it = self.names.iter().zip(&mut self.values).zip(&mut self.grads);
        for ((name, v), g) in it {
            f(ParamMut::host(name, v, g));
        }
    }

    fn num_params(&self) -> usize {
        self.numel()
    }

    /// Frees (`numel == 0`) or gives back zero-filled storage to a
    /// parameter's values and gradient: stage 3 holds one unit at a time.
    fn set_param_storage(&mut self, name: &str, numel: usize) -> Result<()> {
        let i = self.index_of(name)?;
        resize_host_storage(&mut self.values[i], numel);
        resize_host_storage(&mut self.grads[i], numel);
        Ok(())
    }

    fn release_grad(&mut self, name: &str) -> Result<()> {
        let i = self.index_of(name)?;
        resize_host_storage(&mut self.grads[i], 0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel::zero::NoGate;

    /// The hand-derived gradient against central differences.
    #[test]
    fn gradients_match_finite_differences() {
        let mut m = Deep::new(&[3, 5, 4, 2]).unwrap();
        let batch = 2;
        let x: Vec<f32> = (0..batch * 3).map(|i| uniform(90, i as u64)).collect();
        let y: Vec<f32> = (0..batch * 2).map(|i| uniform(91, i as u64)).collect();
        m.loss_and_grad_units(&x, &y, batch, 1.0, &mut NoGate)
            .unwrap();
        let grads = m.grads.clone();
        let h = 1e-3f32;
        let mut checked = 0;
        for (p, gp) in grads.iter().enumerate() {
            for (i, &got) in gp.iter().enumerate() {
                let at = |d: f32| {
                    let mut c = m.clone();
                    c.values[p][i] += d;
                    c.loss_and_grad_units(&x, &y, batch, 0.0, &mut NoGate)
                        .unwrap()
                };
                let num = (at(h) - at(-h)) / (2.0 * h);
                assert!(
                    (num - got).abs() < 2e-3 + 2e-2 * got.abs(),
                    "{} [{i}]: analytic {got}, numeric {num}",
                    m.names[p]
                );
                checked += 1;
            }
        }
        assert_eq!(checked, m.numel());
    }

    #[test]
    fn released_storage_is_freed_and_bad_inputs_are_errors() {
        let mut m = Deep::new(&[4, 3, 1]).unwrap();
        assert_eq!(m.numel(), 4 * 3 + 3 + 3 + 1);
        assert_eq!(m.resident_values(), m.numel());
        m.set_param_storage("fc1.weight", 0).unwrap();
        assert_eq!(m.resident_values(), m.numel() - 12);
        assert_eq!(m.resident_grads(), m.numel() - 12);
        let e = m
            .loss_and_grad_units(&[0.0; 4], &[0.0], 1, 1.0, &mut NoGate)
            .unwrap_err();
        assert!(e.to_string().contains("fc1 is not present"), "{e}");
        assert!(m.set_param_storage("fc9.bias", 0).is_err());
        let e = m
            .loss_and_grad_units(&[0.0; 3], &[0.0], 1, 1.0, &mut NoGate)
            .unwrap_err();
        assert!(e.to_string().contains("needs 4 inputs"), "{e}");
        assert!(Deep::new(&[4]).is_err());
        assert!(Deep::new(&[4, 0, 1]).is_err());
    }
}
