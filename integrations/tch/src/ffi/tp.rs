//! Megatron's `f` and `g` as libtorch autograd functions (`csrc/tp.cpp`):
//! the sums over a tensor-parallel group run in Rust, called from C++ in
//! the forward (`g`) or the backward (`f`).

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use accel_api::{Communicator, Error, ErrorKind, ReduceOp, Result};
use tch::Tensor;

type Reduce =
    extern "C" fn(group: *const c_void, tensor: *mut c_void, err: *mut c_char, len: usize) -> i32;
type Release = extern "C" fn(group: *mut c_void);

extern "C" {
    fn accel_tch_tp_apply(
        x: *const c_void,
        kind: i32,
        group: *mut c_void,
        reduce: Reduce,
        release: Release,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
}

thread_local! {
    /// The error of the last failed all-reduce on this thread, so that a
    /// forward's failure comes back as it was (its kind, rank and op).
    static FAILED: RefCell<Option<Error>> = const { RefCell::new(None) };
}

/// Which collective: Megatron's `f` or `g`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum TpCollective {
    /// Forward unchanged, backward summed.
    CopyToTp = 0,
    /// Forward summed, backward unchanged.
    ReduceFromTp = 1,
}

/// The handle the C++ side owns: a boxed group, freed by [`release`].
type Handle = Arc<dyn Communicator>;

/// Write `msg` NUL-terminated into `err` (cut to fit).
fn write_error(err: *mut c_char, len: usize, msg: &str) {
    if err.is_null() || len == 0 {
        return;
    }
    let n = msg.len().min(len - 1);
    // SAFETY: the shim passes a writable buffer of `len` bytes; `n + 1 <=
    // len` bytes are written.
    unsafe {
        std::ptr::copy_nonoverlapping(msg.as_ptr().cast::<c_char>(), err, n);
        *err.add(n) = 0;
    }
}

/// Sum the shim's tensor over the group in place. Never unwinds into C++.
extern "C" fn reduce(
    group: *const c_void,
    tensor: *mut c_void,
    err: *mut c_char,
    len: usize,
) -> i32 {
    let run = || -> Result<()> {
        // SAFETY: `group` is the boxed handle `apply` gave the shim, alive
        // until `release`, which the shim calls only after its last use.
        let group = unsafe { &*group.cast::<Handle>() };
        // SAFETY: `tensor` is a live `at::Tensor*` the shim owns for this
        // call; `clone_from_ptr` makes a handle of our own to it.
        let mut t = unsafe { Tensor::clone_from_ptr(tensor.cast()) };
        group.all_reduce(crate::tensor_ops::view_mut(&mut t)?, ReduceOp::Sum)
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            write_error(err, len, &e.to_string());
            FAILED.with(|f| *f.borrow_mut() = Some(e));
            1
        }
        Err(_) => {
            write_error(err, len, "the tensor-parallel all-reduce panicked");
            1
        }
    }
}

/// Free a handle made by [`apply`].
extern "C" fn release(group: *mut c_void) {
    // SAFETY: `group` came from `Box::into_raw` in `apply`, and the shim
    // calls this once.
    let _ = catch_unwind(|| drop(unsafe { Box::from_raw(group.cast::<Handle>()) }));
}

/// `which` applied to `x` over `group`, recorded by autograd.
///
/// # Errors
/// The all-reduce's (in the forward of `g`), with libtorch's reason when
/// the shim fails.
pub(crate) fn apply(
    x: &Tensor,
    group: &Arc<dyn Communicator>,
    which: TpCollective,
) -> Result<Tensor> {
    FAILED.with(|f| f.borrow_mut().take());
    let handle = Box::into_raw(Box::new(Arc::clone(group))).cast::<c_void>();
    let mut err = [0 as c_char; 1024];
    // SAFETY: `x` is a live tensor handle borrowed for the call; the shim
    // takes ownership of `handle` (released through `release`, once);
    // `reduce` and `release` match the shim's signatures and never unwind;
    // `err` is writable for its length. The shim catches every C++
    // exception.
    let out = unsafe {
        accel_tch_tp_apply(
            x.as_ptr().cast(),
            which as i32,
            handle,
            reduce,
            release,
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if out.is_null() {
        if let Some(e) = FAILED.with(|f| f.borrow_mut().take()) {
            return Err(e);
        }
        // SAFETY: the shim wrote a NUL-terminated message (or left it 0).
        let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy();
        return Err(Error::new(
            ErrorKind::Backend,
            format!("tensor parallel ({which:?}): {msg}"),
        ));
    }
    // SAFETY: the shim returned a new `at::Tensor*` that we now own.
    Ok(unsafe { Tensor::from_ptr(out.cast()) })
}
