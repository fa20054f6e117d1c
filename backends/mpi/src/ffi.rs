//! Every `unsafe` line of the crate: raw MPI calls through `mpi::ffi`
//! (rsmpi's `mpi-sys` bindings).
//!
//! * [`init`] starts MPI once per process (`MPI_Init_thread`, asking for
//!   `MPI_THREAD_MULTIPLE`) and registers `MPI_Finalize` to run at process
//!   exit.
//! * Every non-blocking MPI call takes [`MPI_LOCK`], so that calls from
//!   several threads never overlap (enough for `MPI_THREAD_SERIALIZED`).
//!   Blocking collectives ([`call_blocking`], in `ffi/blocking.rs`) take no
//!   lock when MPI granted `MPI_THREAD_MULTIPLE`, so that a long call never
//!   stops another thread's MPI calls.
//! * [`Comm`] owns a communicator handle; its `Drop` frees it.
//! * [`start`] begins one non-blocking operation (`MPI_I*`) and returns a
//!   [`Request`] that borrows the caller's memory for `'a` or owns
//!   [`Scratch`] memory. A request that is dropped before MPI finished
//!   with it would leave MPI writing into freed memory, so its `Drop`
//!   aborts the MPI job instead; [`Request::abandon`] may leak a request
//!   (and its scratch memory) only when it borrows nothing.

use std::ffi::{c_int, c_void};
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use mpi::ffi as sys;

mod blocking;
pub(crate) use blocking::call_blocking;

/// Serialises every MPI call of the process.
static MPI_LOCK: Mutex<()> = Mutex::new(());

/// Set once `MPI_Finalize` ran (or started): no MPI call may follow.
static FINALIZED: AtomicBool = AtomicBool::new(false);

/// Blocking calls in flight (`blocking`). The at-exit `MPI_Finalize` is
/// skipped while any is (it would race with them); [`FINALIZED`] stops new
/// ones.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// Set by `init` when MPI granted `MPI_THREAD_MULTIPLE` (blocking calls
/// then take no lock).
static MULTIPLE: AtomicBool = AtomicBool::new(false);

fn lock() -> MutexGuard<'static, ()> {
    MPI_LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) use crate::error::MpiError;

fn error_text(code: c_int) -> String {
    let mut buf = [0 as std::ffi::c_char; sys::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: `buf` holds MPI_MAX_ERROR_STRING characters as the standard
    // requires; MPI_Error_string may be called at any time, even before
    // MPI_Init and after MPI_Finalize.
    let rc = unsafe { sys::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
    if rc != 0 {
        return format!("unknown MPI error {code}");
    }
    let bytes: Vec<u8> = buf[..len.clamp(0, buf.len() as c_int) as usize]
        .iter()
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn check(rc: c_int) -> Result<(), MpiError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(MpiError {
            code: rc,
            text: error_text(rc),
        })
    }
}

fn finalized_error() -> MpiError {
    MpiError {
        code: -1,
        text: "MPI was already finalized (the process is exiting)".into(),
    }
}

/// What [`init`] found.
#[derive(Debug, Clone)]
pub(crate) struct Init {
    /// Rank in `MPI_COMM_WORLD`.
    pub(crate) world_rank: usize,
    /// Size of `MPI_COMM_WORLD`.
    pub(crate) world_size: usize,
    /// `MPI_Get_library_version`, first line.
    pub(crate) library: String,
    /// Largest tag the library accepts (`MPI_TAG_UB`).
    pub(crate) tag_ub: u32,
    /// `true` when this crate called `MPI_Init_thread` (and will finalize).
    pub(crate) initialized_here: bool,
    /// The threading level MPI provides.
    pub(crate) threading: c_int,
}

static INIT: OnceLock<Result<Init, MpiError>> = OnceLock::new();

/// Set when a communicator of this process failed for its group (a
/// timeout, a lost peer): a peer may be stuck, so the at-exit
/// `MPI_Finalize` (which waits for every rank) gets only
/// [`FINALIZE_GRACE`].
static FAILED: AtomicBool = AtomicBool::new(false);

/// How long a process whose group failed waits in `MPI_Finalize` at exit
/// before it leaves without it (mpirun then ends the job).
const FINALIZE_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Record that a group of this process failed (see [`FAILED`]).
pub(crate) fn mark_failed() {
    FAILED.store(true, Ordering::SeqCst);
}

/// Set when a peer of this process ended early (see `progress`): the job
/// has failed, this process holds a request that can never complete, and
/// at exit it ends the MPI job (`MPI_Abort`) instead of finalizing, which
/// would leave mpirun seconds of teardown.
static PEER_LEFT: AtomicBool = AtomicBool::new(false);

/// Record that a peer ended early (see [`PEER_LEFT`]).
pub(crate) fn mark_peer_left() {
    PEER_LEFT.store(true, Ordering::SeqCst);
    mark_failed();
}

fn finalize() {
    let _g = lock();
    if FINALIZED.swap(true, Ordering::SeqCst) {
        return;
    }
    if IN_FLIGHT.load(Ordering::SeqCst) > 0 {
        // Another thread is inside a blocking collective (FINALIZED, set
        // above, stops new ones): finalizing now would race with it.
        return;
    }
    let mut flag: c_int = 0;
    // SAFETY: MPI_Finalized may be called at any time; `flag` is a valid
    // out-pointer.
    unsafe { sys::MPI_Finalized(&mut flag) };
    if flag == 0 {
        // SAFETY: MPI was initialized by this crate (the handler is only
        // registered then) and not finalized yet; the lock keeps every
        // other thread out of MPI, and FINALIZED stops later calls.
        unsafe { sys::MPI_Finalize() };
    }
}

extern "C" fn finalize_at_exit() {
    // Tell the peers that this rank enters no more collectives before
    // waiting for them in MPI_Finalize (a peer waiting for this rank in a
    // collective ends the job instead of waiting for its timeout).
    // Bounded: a store that does not answer must not hold up the exit.
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let marker = std::thread::Builder::new().spawn(move || {
        let _ = std::panic::catch_unwind(crate::progress::exit_all);
        let _ = done_tx.send(());
    });
    if marker.is_ok() {
        let _ = done_rx.recv_timeout(std::time::Duration::from_secs(1));
    }
    if PEER_LEFT.load(Ordering::SeqCst) {
        abort_job(
            "[mpi] a rank of this job ended early (see the error above): ending the MPI job",
            1,
        );
    }
    if !FAILED.load(Ordering::SeqCst) {
        finalize();
        return;
    }
    // A peer may never reach MPI_Finalize: finalize on a helper thread and
    // leave without it after the grace period, so that a failed rank exits
    // instead of waiting for a hung one (mpirun ends the job).
    let (tx, rx) = std::sync::mpsc::channel();
    let helper = std::thread::Builder::new().spawn(move || {
        finalize();
        let _ = tx.send(());
    });
    if helper.is_err() || rx.recv_timeout(FINALIZE_GRACE).is_err() {
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "[mpi] a group of this process failed and MPI_Finalize did not return within {FINALIZE_GRACE:?} (a peer is stuck): exiting without it"
        );
        // SAFETY: ends the process at once without running the rest of the
        // exit handlers, which is the point: MPI_Finalize is still blocked
        // on another thread.
        unsafe { libc::_exit(1) };
    }
}

/// Start MPI once per process (later calls return the first outcome).
///
/// When the program already initialized MPI itself, that initialization is
/// used and left for the program to finalize.
pub(crate) fn init() -> Result<Init, MpiError> {
    INIT.get_or_init(|| {
        let _g = lock();
        let mut flag: c_int = 0;
        // SAFETY: MPI_Initialized may be called before MPI_Init.
        check(unsafe { sys::MPI_Initialized(&mut flag) })?;
        let mut provided: c_int = 0;
        let initialized_here = flag == 0;
        if initialized_here {
            // SAFETY: MPI is not initialized (checked above under the lock,
            // and this closure runs once); null argc/argv are allowed.
            check(unsafe {
                sys::MPI_Init_thread(
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    sys::RSMPI_THREAD_MULTIPLE,
                    &mut provided,
                )
            })?;
            // SAFETY: `finalize_at_exit` is an `extern "C" fn()` that never
            // unwinds.
            unsafe { libc::atexit(finalize_at_exit) };
        } else {
            // SAFETY: MPI is initialized; `provided` is a valid out-pointer.
            check(unsafe { sys::MPI_Query_thread(&mut provided) })?;
        }
        MULTIPLE.store(is_multiple(provided), Ordering::SeqCst);
        // SAFETY: reading an immutable handle exported by rsmpi's C shim.
        let world = unsafe { sys::RSMPI_COMM_WORLD };
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: MPI is initialized; out-pointers are valid.
        check(unsafe { sys::MPI_Comm_rank(world, &mut rank) })?;
        // SAFETY: as above.
        check(unsafe { sys::MPI_Comm_size(world, &mut size) })?;
        // SAFETY: MPI is initialized; errors on COMM_WORLD come back as
        // codes instead of aborting (ERRORS_RETURN is a predefined handle).
        check(unsafe { sys::MPI_Comm_set_errhandler(world, sys::RSMPI_ERRORS_RETURN) })?;
        let mut ub: *mut c_int = std::ptr::null_mut();
        let mut found: c_int = 0;
        // SAFETY: for MPI_TAG_UB the attribute value is an `int*` that MPI
        // writes into `ub`; `found` is a valid out-pointer.
        check(unsafe {
            sys::MPI_Comm_get_attr(
                world,
                sys::MPI_TAG_UB as c_int,
                (&mut ub as *mut *mut c_int).cast::<c_void>(),
                &mut found,
            )
        })?;
        let tag_ub = if found != 0 && !ub.is_null() {
            // SAFETY: MPI returned a pointer to its own static int.
            let v = unsafe { *ub };
            u32::try_from(v).unwrap_or(32767)
        } else {
            32767
        };
        Ok(Init {
            world_rank: rank.max(0) as usize,
            world_size: size.max(1) as usize,
            library: library_version_locked(),
            tag_ub,
            initialized_here,
            threading: provided,
        })
    })
    .clone()
}

fn library_version_locked() -> String {
    let mut buf = [0 as std::ffi::c_char; sys::MPI_MAX_LIBRARY_VERSION_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: `buf` has MPI_MAX_LIBRARY_VERSION_STRING characters; the call
    // is allowed before MPI_Init.
    let rc = unsafe { sys::MPI_Get_library_version(buf.as_mut_ptr(), &mut len) };
    if rc != 0 {
        return String::new();
    }
    let bytes: Vec<u8> = buf[..len.clamp(0, buf.len() as c_int) as usize]
        .iter()
        .map(|&c| c as u8)
        .collect();
    let s = String::from_utf8_lossy(&bytes);
    s.lines()
        .next()
        .unwrap_or("")
        .trim_end_matches(',')
        .trim()
        .to_string()
}

/// `MPI_Get_library_version` without initializing MPI (allowed by the
/// standard): what the probe reports.
pub(crate) fn library_version() -> String {
    let _g = lock();
    library_version_locked()
}

/// `true` when `level` is `MPI_THREAD_MULTIPLE` (any thread may call MPI
/// at any time).
pub(crate) fn is_multiple(level: c_int) -> bool {
    // SAFETY: reading an immutable constant exported by rsmpi's C shim.
    level == unsafe { sys::RSMPI_THREAD_MULTIPLE }
}

/// The name of an `MPI_THREAD_*` level.
pub(crate) fn threading_name(level: c_int) -> &'static str {
    // SAFETY: reading immutable constants exported by rsmpi's C shim.
    let (single, funneled, serialized) = unsafe {
        (
            sys::RSMPI_THREAD_SINGLE,
            sys::RSMPI_THREAD_FUNNELED,
            sys::RSMPI_THREAD_SERIALIZED,
        )
    };
    if level == single {
        "single"
    } else if level == funneled {
        "funneled"
    } else if level == serialized {
        "serialized"
    } else {
        "multiple"
    }
}

/// Print `message` to stderr, then end the whole MPI job with `MPI_Abort`
/// (mpirun names this rank and the code). Never returns.
pub(crate) fn abort_job(message: &str, code: i32) -> ! {
    use std::io::Write as _;
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{message}");
    let _ = err.flush();
    drop(err);
    if !FINALIZED.load(Ordering::SeqCst) {
        // Do not wait for the lock: another thread may hold it while
        // polling; MPI_Abort is the last call this process makes anyway.
        // SAFETY: MPI is initialized (requests exist only after init) and
        // not finalized; MPI_Abort does not return.
        unsafe { sys::MPI_Abort(sys::RSMPI_COMM_WORLD, code) };
    }
    std::process::abort()
}

/// Element types MPI moves or reduces for us.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ty {
    F32,
    F64,
    I8,
    U8,
    I32,
    I64,
    /// Two opaque bytes (f16, bf16 moved, never reduced).
    U16,
}

impl Ty {
    fn raw(self) -> sys::MPI_Datatype {
        // SAFETY: reading immutable datatype handles exported by rsmpi's C
        // shim.
        unsafe {
            match self {
                Ty::F32 => sys::RSMPI_FLOAT,
                Ty::F64 => sys::RSMPI_DOUBLE,
                Ty::I8 => sys::RSMPI_INT8_T,
                Ty::U8 => sys::RSMPI_UINT8_T,
                Ty::I32 => sys::RSMPI_INT32_T,
                Ty::I64 => sys::RSMPI_INT64_T,
                Ty::U16 => sys::RSMPI_UINT16_T,
            }
        }
    }
}

/// MPI's predefined reductions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RedOp {
    Sum,
    Prod,
    Min,
    Max,
}

impl RedOp {
    fn raw(self) -> sys::MPI_Op {
        // SAFETY: reading immutable op handles exported by rsmpi's C shim.
        unsafe {
            match self {
                RedOp::Sum => sys::RSMPI_SUM,
                RedOp::Prod => sys::RSMPI_PROD,
                RedOp::Min => sys::RSMPI_MIN,
                RedOp::Max => sys::RSMPI_MAX,
            }
        }
    }
}

/// `MPI_IN_PLACE`, a macro in `mpi.h` that the bindings do not carry:
/// `(void *) 1` in Open MPI, `(void *) -1` in MPICH and its derivatives
/// (Intel MPI, MVAPICH). Open MPI's handles are pointers and MPICH's are
/// `int`s, which tells the two header families apart; the library string
/// must agree, otherwise `None` (the caller then copies instead).
fn in_place_for(library: &str) -> Option<*mut c_void> {
    let pointer_handles = std::mem::size_of::<sys::MPI_Comm>() == std::mem::size_of::<usize>();
    let open_mpi = library.contains("Open MPI");
    let mpich = ["MPICH", "Intel(R) MPI", "MVAPICH"]
        .iter()
        .any(|m| library.contains(m));
    if pointer_handles && open_mpi {
        Some(std::ptr::without_provenance_mut::<c_void>(1))
    } else if !pointer_handles && mpich {
        Some(std::ptr::without_provenance_mut::<c_void>(usize::MAX))
    } else {
        None
    }
}

/// `true` when this build can pass `MPI_IN_PLACE` to the library it runs
/// on.
pub(crate) fn has_in_place(library: &str) -> bool {
    in_place_for(library).is_some()
}

/// Heap memory, 8-byte aligned, owned by a request while MPI uses it.
#[derive(Debug)]
pub(crate) struct Scratch {
    words: Box<[i64]>,
    bytes: usize,
}

impl Scratch {
    /// `bytes` zeroed bytes.
    pub(crate) fn new(bytes: usize) -> Scratch {
        Scratch {
            words: vec![0i64; bytes.div_ceil(8).max(1)].into_boxed_slice(),
            bytes,
        }
    }

    /// A copy of `src`.
    pub(crate) fn from_bytes(src: &[u8]) -> Scratch {
        let mut s = Scratch::new(src.len());
        s.bytes_mut().copy_from_slice(src);
        s
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &bytemuck_bytes(&self.words)[..self.bytes]
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.bytes;
        &mut bytemuck_bytes_mut(&mut self.words)[..n]
    }
}

fn bytemuck_bytes(w: &[i64]) -> &[u8] {
    accel_api::HostBuf::from(w).bytes()
}

fn bytemuck_bytes_mut(w: &mut [i64]) -> &mut [u8] {
    accel_api::HostBufMut::from(w).into_bytes()
}

/// Where the data an operation sends comes from.
#[derive(Debug)]
pub(crate) enum Src<'a> {
    /// Nothing is sent (a non-root rank of a scatter).
    None,
    /// The data is already in the receive buffer (`MPI_IN_PLACE`).
    InPlace,
    /// The caller's memory.
    User(&'a [u8]),
    /// The first `n` bytes of the request's scratch (send part).
    Scratch,
}

/// Where the data an operation receives goes.
#[derive(Debug)]
pub(crate) enum Dst<'a> {
    /// Nothing is received here (a non-root rank of a gather).
    None,
    /// The caller's memory.
    User(&'a mut [u8]),
    /// The request's receive scratch.
    Scratch,
}

/// One non-blocking operation to start.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Call {
    AllReduce(RedOp),
    Reduce(RedOp, c_int),
    Bcast(c_int),
    AllGather,
    Gather(c_int),
    Scatter(c_int),
    ReduceScatterBlock(RedOp),
    AllToAll,
    Barrier,
    Send { dst: c_int, tag: c_int },
}

/// Owned memory a request may hold: the send scratch and the receive
/// scratch.
#[derive(Debug, Default)]
pub(crate) struct Owned {
    pub(crate) send: Option<Scratch>,
    pub(crate) recv: Option<Scratch>,
}

/// An MPI communicator handle. `Drop` frees it (`MPI_Comm_free`, a local
/// operation in practice; pending operations on it still complete).
#[derive(Debug)]
pub(crate) struct Comm {
    raw: sys::MPI_Comm,
    world: bool,
}

// SAFETY: a communicator handle is an opaque reference to library state;
// every use goes through MPI_LOCK, so the handle may move between threads
// and be shared by them.
unsafe impl Send for Comm {}
// SAFETY: as above: all access is serialised by MPI_LOCK.
unsafe impl Sync for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.world {
            return;
        }
        let _g = lock();
        if FINALIZED.load(Ordering::SeqCst) {
            return;
        }
        // SAFETY: `raw` is a communicator this process created and has not
        // freed; MPI is initialized and not finalized (checked under the
        // lock).
        unsafe { sys::MPI_Comm_free(&mut self.raw) };
    }
}

impl Comm {
    /// `MPI_COMM_WORLD` (never freed).
    pub(crate) fn world() -> Comm {
        Comm {
            // SAFETY: reading an immutable handle exported by rsmpi's C shim.
            raw: unsafe { sys::RSMPI_COMM_WORLD },
            world: true,
        }
    }

    /// `MPI_Comm_split` with `color` (`None`: `MPI_UNDEFINED`) and `key`.
    /// Blocking: call it only once every member is known to have entered.
    pub(crate) fn split(&self, color: Option<c_int>, key: c_int) -> Result<Option<Comm>, MpiError> {
        let _g = lock();
        if FINALIZED.load(Ordering::SeqCst) {
            return Err(finalized_error());
        }
        // SAFETY: reading an immutable constant.
        let color = color.unwrap_or(unsafe { sys::RSMPI_UNDEFINED });
        let mut out = MaybeUninit::<sys::MPI_Comm>::uninit();
        // SAFETY: `self.raw` is a live communicator; `out` is a valid
        // out-pointer that MPI fills before returning (the call blocks).
        check(unsafe { sys::MPI_Comm_split(self.raw, color, key, out.as_mut_ptr()) })?;
        // SAFETY: MPI_Comm_split succeeded and wrote `out`.
        let raw = unsafe { out.assume_init() };
        // SAFETY: reading an immutable handle.
        if raw == unsafe { sys::RSMPI_COMM_NULL } {
            return Ok(None);
        }
        // SAFETY: `raw` is the new live communicator.
        check(unsafe { sys::MPI_Comm_set_errhandler(raw, sys::RSMPI_ERRORS_RETURN) })?;
        Ok(Some(Comm { raw, world: false }))
    }

    /// Start `MPI_Comm_idup` of this communicator. The new handle lives in
    /// memory the request owns; take it with [`Request::into_comm`] once
    /// complete.
    pub(crate) fn idup(&self) -> Result<Request<'static>, MpiError> {
        let _g = lock();
        if FINALIZED.load(Ordering::SeqCst) {
            return Err(finalized_error());
        }
        // SAFETY: reading an immutable handle.
        let mut slot = Box::new(unsafe { sys::RSMPI_COMM_NULL });
        // SAFETY: reading an immutable handle.
        let mut req = unsafe { sys::RSMPI_REQUEST_NULL };
        // SAFETY: `self.raw` is live; `slot` is heap memory owned by the
        // returned request (which never frees it while MPI may write it);
        // `req` is a valid out-pointer.
        check(unsafe { sys::MPI_Comm_idup(self.raw, &mut *slot, &mut req) })?;
        Ok(Request::new(req, Owned::default(), Some(slot), false))
    }
}

fn ptr_of(s: &Src<'_>, owned: &Owned, in_place: *mut c_void) -> *const c_void {
    match s {
        Src::None => std::ptr::null(),
        Src::InPlace => in_place as *const c_void,
        Src::User(b) => b.as_ptr().cast(),
        Src::Scratch => owned
            .send
            .as_ref()
            .map_or(std::ptr::null(), |s| s.bytes().as_ptr().cast()),
    }
}

fn mut_ptr_of(d: &mut Dst<'_>, owned: &mut Owned) -> *mut c_void {
    match d {
        Dst::None => std::ptr::null_mut(),
        Dst::User(b) => b.as_mut_ptr().cast(),
        Dst::Scratch => owned
            .recv
            .as_mut()
            .map_or(std::ptr::null_mut(), |s| s.bytes_mut().as_mut_ptr().cast()),
    }
}

/// One operation for [`start`] or [`call_blocking`]: `call` on `count`
/// elements of `ty` (per rank for the gathers and scatters, per destination
/// for all-to-all), from `send` into `recv`.
#[derive(Debug)]
pub(crate) struct Transfer<'a> {
    pub(crate) call: Call,
    pub(crate) ty: Ty,
    pub(crate) count: c_int,
    pub(crate) send: Src<'a>,
    pub(crate) recv: Dst<'a>,
}

impl Transfer<'_> {
    /// The send and receive pointers (`MPI_IN_PLACE` for [`Src::InPlace`];
    /// an error when this library's value of it is unknown).
    fn pointers(
        &mut self,
        owned: &mut Owned,
        library: &str,
    ) -> Result<(*const c_void, *mut c_void), MpiError> {
        let in_place = in_place_for(library).unwrap_or(std::ptr::null_mut());
        if matches!(self.send, Src::InPlace) && in_place.is_null() {
            return Err(MpiError {
                code: -1,
                text: "MPI_IN_PLACE is not known for this MPI library".into(),
            });
        }
        let sp = ptr_of(&self.send, owned, in_place);
        Ok((sp, mut_ptr_of(&mut self.recv, owned)))
    }
}

/// Start the transfer `t` on `comm`.
///
/// Buffer sizes are the caller's contract (checked by the communicator
/// before any call): a send buffer of `count` elements (`count x size` for
/// scatter and all-to-all at the root), a receive buffer of `count`
/// elements (`count x size` for gathers at the root and all-to-all).
/// `library` is the MPI library string, for `MPI_IN_PLACE`.
pub(crate) fn start<'a>(
    comm: &Comm,
    mut t: Transfer<'a>,
    mut owned: Owned,
    library: &str,
) -> Result<Request<'a>, MpiError> {
    let borrows_user = matches!(t.send, Src::User(_)) || matches!(t.recv, Dst::User(_));
    let (sp, rp) = t.pointers(&mut owned, library)?;
    let (call, count, dt, c) = (t.call, t.count, t.ty.raw(), comm.raw);
    let _g = lock();
    if FINALIZED.load(Ordering::SeqCst) {
        return Err(finalized_error());
    }
    // SAFETY: reading an immutable handle.
    let mut req = unsafe { sys::RSMPI_REQUEST_NULL };
    let r = &mut req;
    // SAFETY: for every arm: MPI is initialized and not finalized (checked
    // under the lock that serialises all MPI calls); `c` is a live
    // communicator; `sp`/`rp` point to memory that stays valid until the
    // request completes: caller memory borrowed for `'a` by the returned
    // request (which aborts the job in `Drop` rather than release it
    // early), or scratch owned by the request (heap memory, not moved by
    // moving the request). The caller checked that the buffers hold the
    // element counts the call reads and writes.
    let rc = unsafe {
        match call {
            Call::AllReduce(op) => sys::MPI_Iallreduce(sp, rp, count, dt, op.raw(), c, r),
            Call::Reduce(op, root) => sys::MPI_Ireduce(sp, rp, count, dt, op.raw(), root, c, r),
            Call::Bcast(root) => sys::MPI_Ibcast(rp, count, dt, root, c, r),
            Call::AllGather => sys::MPI_Iallgather(sp, count, dt, rp, count, dt, c, r),
            Call::Gather(root) => sys::MPI_Igather(sp, count, dt, rp, count, dt, root, c, r),
            Call::Scatter(root) => sys::MPI_Iscatter(sp, count, dt, rp, count, dt, root, c, r),
            Call::ReduceScatterBlock(op) => {
                sys::MPI_Ireduce_scatter_block(sp, rp, count, dt, op.raw(), c, r)
            }
            Call::AllToAll => sys::MPI_Ialltoall(sp, count, dt, rp, count, dt, c, r),
            Call::Barrier => sys::MPI_Ibarrier(c, r),
            Call::Send { dst, tag } => sys::MPI_Isend(sp, count, dt, dst, tag, c, r),
        }
    };
    check(rc)?;
    Ok(Request::new(req, owned, None, borrows_user))
}

/// A matched incoming message (`MPI_Improbe`), not yet received.
#[derive(Debug)]
pub(crate) struct Matched {
    raw: sys::MPI_Message,
    /// Its size in bytes.
    pub(crate) bytes: usize,
}

/// Look (without waiting) for a message from `src` with `tag`; when one is
/// there, match it so that only [`Matched::receive`] can take it.
pub(crate) fn improbe(comm: &Comm, src: c_int, tag: c_int) -> Result<Option<Matched>, MpiError> {
    let _g = lock();
    if FINALIZED.load(Ordering::SeqCst) {
        return Err(finalized_error());
    }
    let mut flag: c_int = 0;
    // SAFETY: reading an immutable handle.
    let mut msg = unsafe { sys::RSMPI_MESSAGE_NULL };
    let mut status = MaybeUninit::<sys::MPI_Status>::zeroed();
    // SAFETY: `comm` is live; all out-pointers are valid.
    check(unsafe {
        sys::MPI_Improbe(src, tag, comm.raw, &mut flag, &mut msg, status.as_mut_ptr())
    })?;
    if flag == 0 {
        return Ok(None);
    }
    let mut count: c_int = 0;
    // SAFETY: MPI_Improbe found a message and filled `status`; counting it
    // in bytes (UINT8_T) is always exact.
    check(unsafe { sys::MPI_Get_count(status.as_ptr(), Ty::U8.raw(), &mut count) })?;
    Ok(Some(Matched {
        raw: msg,
        bytes: count.max(0) as usize,
    }))
}

impl Matched {
    /// Start receiving the matched message into `dst` (exactly
    /// `self.bytes` long) or into owned scratch.
    pub(crate) fn receive<'a>(
        mut self,
        mut dst: Dst<'a>,
        mut owned: Owned,
    ) -> Result<Request<'a>, MpiError> {
        let borrows_user = matches!(dst, Dst::User(_));
        let rp = mut_ptr_of(&mut dst, &mut owned);
        let count = c_int::try_from(self.bytes).map_err(|_| MpiError {
            code: -1,
            text: "message larger than 2^31 bytes".into(),
        })?;
        let _g = lock();
        if FINALIZED.load(Ordering::SeqCst) {
            return Err(finalized_error());
        }
        // SAFETY: reading an immutable handle.
        let mut req = unsafe { sys::RSMPI_REQUEST_NULL };
        // SAFETY: `self.raw` is a matched message not yet received; `rp`
        // points to `self.bytes` writable bytes that outlive the request
        // (as in `start`).
        check(unsafe { sys::MPI_Imrecv(rp, count, Ty::U8.raw(), &mut self.raw, &mut req) })?;
        Ok(Request::new(req, owned, None, borrows_user))
    }
}

/// A started non-blocking operation. Poll it with [`test`](Self::test).
#[derive(Debug)]
pub(crate) struct Request<'a> {
    raw: sys::MPI_Request,
    done: bool,
    owned: Owned,
    comm_slot: Option<Box<sys::MPI_Comm>>,
    borrows_user: bool,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> Request<'a> {
    /// The started request `raw`, which owns `owned` (and the new
    /// communicator's handle for `MPI_Comm_idup`); `borrows_user` when it
    /// reads or writes caller memory.
    fn new(
        raw: sys::MPI_Request,
        owned: Owned,
        comm_slot: Option<Box<sys::MPI_Comm>>,
        borrows_user: bool,
    ) -> Request<'a> {
        Request {
            raw,
            done: false,
            owned,
            comm_slot,
            borrows_user,
            _borrow: PhantomData,
        }
    }

    /// `MPI_Test`: `Ok(true)` once complete. An error completes the request
    /// too (MPI frees it).
    pub(crate) fn test(&mut self) -> Result<bool, MpiError> {
        if self.done {
            return Ok(true);
        }
        let _g = lock();
        if FINALIZED.load(Ordering::SeqCst) {
            return Err(finalized_error());
        }
        let mut flag: c_int = 0;
        let mut status = MaybeUninit::<sys::MPI_Status>::zeroed();
        // SAFETY: `self.raw` is an active request of this process (or
        // REQUEST_NULL, for which MPI_Test returns at once).
        let rc = unsafe { sys::MPI_Test(&mut self.raw, &mut flag, status.as_mut_ptr()) };
        if rc != 0 {
            self.done = true;
            return Err(MpiError {
                code: rc,
                text: error_text(rc),
            });
        }
        if flag != 0 {
            self.done = true;
        }
        Ok(self.done)
    }

    /// The owned memory back, once complete.
    pub(crate) fn finish(mut self) -> Owned {
        debug_assert!(self.done);
        std::mem::take(&mut self.owned)
    }

    /// The communicator an `idup` made, once complete.
    pub(crate) fn into_comm(mut self) -> Option<Comm> {
        if !self.done {
            return None;
        }
        let raw = *self.comm_slot.take()?;
        let c = Comm { raw, world: false };
        // SAFETY: reading an immutable handle; `c.raw` is the live new
        // communicator made by the completed MPI_Comm_idup.
        let _ = check(unsafe { sys::MPI_Comm_set_errhandler(c.raw, sys::RSMPI_ERRORS_RETURN) });
        Some(c)
    }

    /// Give up on an unfinished request without waiting: possible only
    /// when it borrows no caller memory. Its owned memory is leaked so that
    /// MPI can still write into it. `Err(self)` when it borrows caller
    /// memory (the caller must then end the job).
    pub(crate) fn abandon(mut self) -> Result<(), Request<'a>> {
        if self.borrows_user && !self.done {
            return Err(self);
        }
        std::mem::forget(std::mem::take(&mut self.owned));
        std::mem::forget(self.comm_slot.take());
        self.done = true;
        Ok(())
    }

    /// `true` when the request references caller memory.
    pub(crate) fn borrows_user(&self) -> bool {
        self.borrows_user
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        if !self.done {
            // Releasing memory MPI may still write into is not an option.
            abort_job(
                "[mpi] internal error: an MPI request was released before it completed; aborting the MPI job",
                70,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_place_needs_matching_library() {
        // This build links Open MPI (pointer handles).
        assert!(has_in_place("Open MPI v4.1.4, package: Debian OpenMPI"));
        assert!(!has_in_place("MPICH Version: 4.0"));
        assert!(!has_in_place(""));
    }

    #[test]
    fn scratch_is_zeroed_and_sized() {
        let s = Scratch::new(13);
        assert_eq!(s.bytes().len(), 13);
        assert!(s.bytes().iter().all(|&b| b == 0));
        let c = Scratch::from_bytes(&[1, 2, 3]);
        assert_eq!(c.bytes(), &[1, 2, 3]);
    }
}
