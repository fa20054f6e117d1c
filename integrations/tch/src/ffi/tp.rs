//! Megatron's `f` and `g` and the sequence-parallel scatter, gather and
//! reduce-scatter as libtorch autograd functions (`csrc/tp.cpp`): the
//! collectives over a tensor-parallel group run in Rust, called from C++ in
//! the forward or the backward.

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use accel_api::{Buf, Communicator, Error, ErrorKind, ReduceOp, Result};
use tch::Tensor;

type Collective = extern "C" fn(
    group: *const c_void,
    op: i32,
    input: *const c_void,
    out: *mut c_void,
    err: *mut c_char,
    len: usize,
) -> i32;
type Release = extern "C" fn(group: *mut c_void);

extern "C" {
    fn accel_tch_tp_apply(
        x: *const c_void,
        kind: i32,
        group: *mut c_void,
        size: i64,
        rank: i64,
        run: Collective,
        release: Release,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
}

thread_local! {
    /// The error of the last failed collective on this thread, so that a
    /// forward's failure comes back as it was (its kind, rank and op).
    static FAILED: RefCell<Option<Error>> = const { RefCell::new(None) };
}

/// Which function: Megatron's `f` or `g`, or a sequence-parallel one
/// (rows of dimension 0).
#[derive(Clone, Copy, Debug)]
pub(crate) enum TpCollective {
    /// Forward unchanged, backward summed.
    CopyToTp = 0,
    /// Forward summed, backward unchanged.
    ReduceFromTp = 1,
    /// Forward this rank's rows, backward all-gathered.
    ScatterToSp = 2,
    /// Forward all-gathered, backward reduce-scattered.
    GatherFromSp = 3,
    /// Forward reduce-scattered, backward all-gathered.
    ReduceScatterToSp = 4,
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

/// A read-only view of `t`: of its device memory on CUDA, of its host
/// memory otherwise.
fn view(t: &Tensor) -> Result<Buf<'_>> {
    Ok(if let tch::Device::Cuda(_) = t.device() {
        Buf::Device(super::device_view(t)?)
    } else {
        Buf::Host(super::host_view(t)?)
    })
}

/// Run the shim's collective `op` (0 sum in place, 1 all-gather rows, 2
/// reduce-scatter rows) from `input` into `out`. Never unwinds into C++.
extern "C" fn run(
    group: *const c_void,
    op: i32,
    input: *const c_void,
    out: *mut c_void,
    err: *mut c_char,
    len: usize,
) -> i32 {
    let go = || -> Result<()> {
        // SAFETY: `group` is the boxed handle `apply` gave the shim, alive
        // until `release`, which the shim calls only after its last use.
        let group = unsafe { &*group.cast::<Handle>() };
        // SAFETY: `out` (and `input`) are live `at::Tensor*`s the shim owns
        // for this call; `clone_from_ptr` makes handles of our own to them
        // (to the same storage; for op 0 they are one tensor, read through
        // `out` only).
        let mut out = unsafe { Tensor::clone_from_ptr(out.cast()) };
        let recv = crate::tensor_ops::view_mut(&mut out)?;
        if op == 0 {
            return group.all_reduce(recv, ReduceOp::Sum);
        }
        // SAFETY: as above.
        let input = unsafe { Tensor::clone_from_ptr(input.cast_mut().cast()) };
        match op {
            1 => group.all_gather(view(&input)?, recv),
            _ => group.reduce_scatter(view(&input)?, recv, ReduceOp::Sum),
        }
    };
    match catch_unwind(AssertUnwindSafe(go)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            write_error(err, len, &e.to_string());
            FAILED.with(|f| *f.borrow_mut() = Some(e));
            1
        }
        Err(_) => {
            write_error(err, len, "a tensor-parallel collective panicked");
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
/// The collective's (when the forward runs one), with libtorch's reason
/// when the shim fails (a sequence that does not split evenly).
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
    // `run` and `release` match the shim's signatures and never unwind;
    // `err` is writable for its length. The shim catches every C++
    // exception.
    let out = unsafe {
        accel_tch_tp_apply(
            x.as_ptr().cast(),
            which as i32,
            handle,
            group.world_size() as i64,
            group.rank() as i64,
            run,
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
