//! Blocking MPI collectives (`MPI_Allreduce`, `MPI_Bcast`, ...): the fast
//! path. MPI cannot cancel them and accel cannot bound them from inside, so
//! the engine arms the watchdog (`crate::watchdog`) around each call, which
//! ends the MPI job when a call outlives the timeout.
//!
//! With `MPI_THREAD_MULTIPLE` a blocking call takes no lock: a call that
//! waits for a late rank never stops another thread's MPI calls (the
//! non-blocking path's [`MPI_LOCK`](super::MPI_LOCK) only serialises the
//! short calls among themselves). At a lower level the call holds the lock
//! for its whole duration, which is what `MPI_THREAD_SERIALIZED` requires;
//! the engine then does not use this path at all (see `Shared::blocking`).

use super::*;

/// Decrements [`IN_FLIGHT`] when the call is over.
struct InFlight;

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Run the transfer `t` on `comm` with the blocking MPI function, to
/// completion.
///
/// The arguments are those of [`start`](super::start): buffers sized by the caller's contract (checked by the
/// communicator before any call), `owned` holding the scratch memory that
/// `Src::Scratch` / `Dst::Scratch` name. Nothing is borrowed past the
/// return, because MPI is done with every buffer when a blocking call
/// returns.
pub(crate) fn call_blocking(
    comm: &Comm,
    mut t: Transfer<'_>,
    owned: &mut Owned,
    library: &str,
) -> Result<(), MpiError> {
    let (sp, rp) = t.pointers(owned, library)?;
    let (call, count, dt, c) = (t.call, t.count, t.ty.raw(), comm.raw);
    IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
    let _in_flight = InFlight;
    // Below MPI_THREAD_MULTIPLE, the call must not overlap any other.
    let _g = (!MULTIPLE.load(Ordering::SeqCst)).then(lock);
    if FINALIZED.load(Ordering::SeqCst) {
        return Err(finalized_error());
    }
    // SAFETY: for every arm: MPI is initialized (communicators exist only
    // after init) and not finalized (checked after counting this call in
    // IN_FLIGHT, which the at-exit finalize checks after setting
    // FINALIZED); calls overlap other threads' MPI calls only under
    // MPI_THREAD_MULTIPLE (otherwise MPI_LOCK is held); `c` is a live
    // communicator; `sp`/`rp` point to caller memory borrowed for the
    // duration of this call or to scratch memory in `owned`, which the
    // caller keeps alive across it, sized as the call reads and writes them
    // (checked by the communicator before any call).
    let rc = unsafe {
        match call {
            Call::AllReduce(op) => sys::MPI_Allreduce(sp, rp, count, dt, op.raw(), c),
            Call::Reduce(op, root) => sys::MPI_Reduce(sp, rp, count, dt, op.raw(), root, c),
            Call::Bcast(root) => sys::MPI_Bcast(rp, count, dt, root, c),
            Call::AllGather => sys::MPI_Allgather(sp, count, dt, rp, count, dt, c),
            Call::Gather(root) => sys::MPI_Gather(sp, count, dt, rp, count, dt, root, c),
            Call::Scatter(root) => sys::MPI_Scatter(sp, count, dt, rp, count, dt, root, c),
            Call::ReduceScatterBlock(op) => {
                sys::MPI_Reduce_scatter_block(sp, rp, count, dt, op.raw(), c)
            }
            Call::AllToAll => sys::MPI_Alltoall(sp, count, dt, rp, count, dt, c),
            Call::Barrier => sys::MPI_Barrier(c),
            Call::Send { dst, tag } => sys::MPI_Send(sp, count, dt, dst, tag, c),
        }
    };
    check(rc)
}
