//! Post hooks on gradient accumulators (`csrc/grad_hooks.cpp`): a backward
//! pass reports each parameter whose gradient it has finished, while it
//! runs.

use std::any::Any;
use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::Mutex;
use std::thread::{self, ThreadId};

use accel_api::sync::lock;
use accel_api::{Error, ErrorKind, Result};
use tch::Tensor;

type Ready = extern "C" fn(ctx: *const c_void, index: usize);

extern "C" {
    fn accel_tch_grad_hooks_arm(
        tensors: *const *const c_void,
        n: usize,
        ready: Ready,
        ctx: *const c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
    fn accel_tch_grad_hooks_disarm(armed: *mut c_void);
    fn accel_tch_grad_post_hooks(tensor: *const c_void) -> i64;
    fn accel_tch_grad_to_none(tensor: *const c_void) -> i32;
}

/// What the hooks of one [`GradHooks`] point at. Shared with libtorch's
/// threads (a device's autograd thread may run a hook), hence only atomics
/// and locks.
struct Slot {
    /// The thread that armed the hooks (and runs the backward).
    owner: ThreadId,
    /// During [`GradHooks::backward`]: the address of the receiver (a
    /// `&mut dyn FnMut(usize)` on `backward`'s frame); null otherwise.
    receiver: AtomicPtr<c_void>,
    /// A report is being delivered to the receiver.
    busy: AtomicBool,
    /// Reports not delivered at once (made on another thread, by a backward
    /// nested inside the receiver, outside `backward`, or after a panic):
    /// delivered when the backward has returned.
    queued: Mutex<Vec<usize>>,
    /// The receiver's first panic, resumed when the backward has returned.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Slot {
    /// Report `index`: to the receiver when this is the owner thread inside
    /// `backward` and no report is being delivered; to the queue otherwise.
    fn report(&self, index: usize) {
        let on_owner = thread::current().id() == self.owner;
        let receiver = self.receiver.load(Ordering::Acquire);
        if !on_owner
            || receiver.is_null()
            || lock(&self.panic).is_some()
            || self.busy.swap(true, Ordering::Acquire)
        {
            lock(&self.queued).push(index);
            return;
        }
        let receiver = receiver.cast::<&mut dyn FnMut(usize)>();
        // SAFETY: `receiver` is non-null, so `GradHooks::backward` is running
        // on this thread (the owner; `GradHooks` is not `Send`) and it points
        // at the `&mut dyn FnMut(usize)` on that call's frame, which is
        // suspended inside libtorch's `backward()` and touches the receiver
        // only after that returns and it has cleared the pointer. `busy`
        // was false and is now set, so no other reference made here exists
        // (a hook run by a backward nested inside the receiver queues its
        // report above). So this is the only live reference to it.
        let f = unsafe { &mut *receiver };
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(index))) {
            lock(&self.panic).get_or_insert(p);
        }
        self.busy.store(false, Ordering::Release);
    }
}

/// The hooks' entry point: never unwinds into C++.
extern "C" fn grad_ready(ctx: *const c_void, index: usize) {
    // SAFETY: `ctx` is the `Slot` of the `GradHooks` whose hooks call this;
    // it is freed only after they are removed (`Drop`), and it is `Sync`.
    let slot = unsafe { &*ctx.cast::<Slot>() };
    // `report` catches the receiver's panics; this catches its own (a
    // thread without a handle, say), which must not reach C++ either. The
    // report is then queued, so it is still delivered after the backward
    // (the receiver ignores a second report of one tensor).
    if catch_unwind(AssertUnwindSafe(|| slot.report(index))).is_err() {
        lock(&slot.queued).push(index);
    }
}

/// One post hook per tensor on its gradient accumulator (torch DDP's
/// `Reducer` hooks), armed until this is dropped: each reports the
/// tensor's index once autograd has accumulated its gradient for the
/// running backward. Crate-private, and only ever used by
/// [`backward`](Self::backward) on its own frame.
///
/// # Soundness
/// The hooks point at a heap `Slot` owned by this value and freed only
/// after the hooks are removed; if this value were leaked, the hooks would
/// keep pointing at the leaked (still valid) slot and queue their reports.
/// The receiver is reachable through the slot only while `backward` runs
/// (the pointer is cleared when it returns, even by unwinding), only from
/// the owner thread (a hook on another thread queues), and never twice at
/// once (`busy`).
pub(crate) struct GradHooks {
    armed: NonNull<c_void>,
    slot: NonNull<Slot>,
}

impl std::fmt::Debug for GradHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradHooks").finish_non_exhaustive()
    }
}

impl GradHooks {
    /// Arm a hook on the gradient accumulator of each of the named
    /// `tensors` (leaves that require a gradient); the hook of `tensors[i]`
    /// reports `i`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming the tensor when one is not a
    /// leaf or requires no gradient, or with libtorch's reason when it
    /// cannot hook an accumulator; nothing is armed then.
    pub(crate) fn arm(tensors: &[(String, Tensor)]) -> Result<GradHooks> {
        if let Some((name, t)) = tensors
            .iter()
            .find(|(_, t)| !t.requires_grad() || !t.is_leaf())
        {
            let why = if t.requires_grad() {
                "is not a leaf of the autograd graph"
            } else {
                "does not require a gradient"
            };
            return Err(Error::invalid_argument(
                "backward_reporting",
                format!("cannot hook the gradient of parameter {name:?}: it {why}"),
            )
            .with_fix("report only leaf tensors that require a gradient (a VarStore's trainable variables; do not freeze one after wrapping the VarStore)"));
        }
        let slot = Box::new(Slot {
            owner: thread::current().id(),
            receiver: AtomicPtr::new(std::ptr::null_mut()),
            busy: AtomicBool::new(false),
            queued: Mutex::new(Vec::new()),
            panic: Mutex::new(None),
        });
        let slot = NonNull::from(Box::leak(slot));
        let ptrs: Vec<*const c_void> = tensors.iter().map(|(_, t)| t.as_ptr().cast()).collect();
        let mut err = [0 as c_char; 512];
        // SAFETY: `ptrs` holds `ptrs.len()` pointers to live `at::Tensor`s
        // (tch's handles, borrowed for this call); the shim uses them only
        // during the call. `grad_ready` matches the `Ready` signature and
        // never unwinds. `slot` stays valid until `Drop` (after disarming)
        // or forever. `err` is a writable buffer of its length, which the
        // shim NUL-terminates. The shim catches every C++ exception.
        let armed = unsafe {
            accel_tch_grad_hooks_arm(
                ptrs.as_ptr(),
                ptrs.len(),
                grad_ready,
                slot.as_ptr().cast_const().cast(),
                err.as_mut_ptr(),
                err.len(),
            )
        };
        match NonNull::new(armed) {
            Some(armed) => Ok(GradHooks { armed, slot }),
            None => {
                // SAFETY: nothing was armed, so nothing points at the slot,
                // which `Box::leak` made above.
                drop(unsafe { Box::from_raw(slot.as_ptr()) });
                // SAFETY: the shim wrote a NUL-terminated message into
                // `err` (or left its first byte 0).
                let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy();
                Err(Error::invalid_argument(
                    "backward_reporting",
                    format!("libtorch could not hook a gradient accumulator: {msg}"),
                )
                .with_fix("report only leaf tensors that require a gradient (a VarStore's trainable variables)"))
            }
        }
    }

    fn slot(&self) -> &Slot {
        // SAFETY: the slot lives until `Drop` frees it, and is only ever
        // shared.
        unsafe { self.slot.as_ref() }
    }

    /// Run `loss.backward()` with the hooks armed, calling `receiver` with
    /// each hooked tensor's index as its gradient becomes final: inside
    /// `backward()` when libtorch runs the hook on this thread (the CPU),
    /// after it returns for the reports made on another thread (a device's
    /// autograd thread) or by a backward nested inside `receiver`. Every
    /// report is delivered once before this returns.
    ///
    /// # Panics
    /// `receiver`'s panic, resumed after the backward has returned (it
    /// never crosses libtorch).
    ///
    /// # Errors
    /// [`ErrorKind::Backend`] when libtorch's backward fails (a loss that
    /// requires no gradient, say).
    pub(crate) fn backward(&self, loss: &Tensor, receiver: &mut dyn FnMut(usize)) -> Result<()> {
        /// Clears the receiver when the backward returns, or unwinds.
        struct Clear<'a>(&'a Slot);
        impl Drop for Clear<'_> {
            fn drop(&mut self) {
                self.0
                    .receiver
                    .store(std::ptr::null_mut(), Ordering::Release);
            }
        }
        let slot = self.slot();
        let mut recv: &mut dyn FnMut(usize) = receiver;
        slot.receiver.store(
            std::ptr::addr_of_mut!(recv).cast::<c_void>(),
            Ordering::Release,
        );
        let clear = Clear(slot);
        let result = loss.f_backward();
        drop(clear);
        if let Some(p) = lock(&slot.panic).take() {
            std::panic::resume_unwind(p);
        }
        let queued = std::mem::take(&mut *lock(&slot.queued));
        for i in queued {
            recv(i);
        }
        result.map_err(|e| {
            Error::new(ErrorKind::Backend, format!("libtorch backward: {e}"))
                .with_op("backward_reporting")
                .with_fix("call it with a scalar loss computed from the model's parameters")
        })
    }
}

impl Drop for GradHooks {
    fn drop(&mut self) {
        // SAFETY: `armed` came from `accel_tch_grad_hooks_arm` and is
        // disarmed once, here; the shim catches every C++ exception.
        unsafe { accel_tch_grad_hooks_disarm(self.armed.as_ptr()) };
        // SAFETY: the hooks are removed, so nothing points at the slot any
        // more; it came from `Box::leak` in `arm`.
        drop(unsafe { Box::from_raw(self.slot.as_ptr()) });
    }
}

/// How many post hooks the gradient accumulator of `t` holds now (0 when
/// it has none, or no accumulator): a check that no hook outlives its
/// backward ([`TchModel::backward_reporting`](crate::TchModel::backward_reporting)
/// removes its hooks when it returns).
///
/// # Errors
/// [`ErrorKind::Backend`] when libtorch fails to say.
pub fn grad_post_hooks(t: &Tensor) -> Result<usize> {
    // SAFETY: `t.as_ptr()` points at a live `at::Tensor` for this call; the
    // shim only reads it and catches every C++ exception.
    let n = unsafe { accel_tch_grad_post_hooks(t.as_ptr().cast()) };
    usize::try_from(n).map_err(|_| {
        Error::new(
            ErrorKind::Backend,
            "libtorch failed to list a gradient accumulator's hooks",
        )
    })
}

/// Set `t`'s gradient to none (torch's `zero_grad(set_to_none=True)`): its
/// storage is freed, and autograd allocates a new one at the next backward.
///
/// # Errors
/// [`ErrorKind::Backend`] when libtorch fails.
pub(crate) fn grad_to_none(t: &Tensor) -> Result<()> {
    // SAFETY: `t.as_ptr()` points at a live `at::Tensor` for this call; the
    // shim resets its gradient slot and catches every C++ exception.
    let rc = unsafe { accel_tch_grad_to_none(t.as_ptr().cast()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::Backend,
            "libtorch failed to set a gradient to none",
        ))
    }
}
