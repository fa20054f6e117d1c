//! What a started call owns: its buffers ([`OwnedBuf`]) and the call
//! itself ([`Call`], and [`CallMut`], its views).

use std::any::Any;
use std::fmt;
use std::time::Duration;

use crate::{Buf, BufMut, DType, Element, HostBuf, HostBufMut, Op, ReduceOp};

/// How long past the communicator's timeout a handle waits for an engine
/// that began a call before it gives up on the engine itself.
pub const ENGINE_GRACE: Duration = Duration::from_secs(2);

/// Memory a handle can own while its call is in flight: host vectors, or a
/// framework's tensor (a device tensor's owner implements this to hand out
/// [`DeviceBuf`](crate::DeviceBuf) views).
///
/// The views must describe the same memory, element type and length every
/// time they are asked for while the call is in flight.
pub trait OwnedBuf: Any + Send {
    /// A read-only view of the memory.
    fn buf(&self) -> Buf<'_>;

    /// A writable view of the memory.
    fn buf_mut(&mut self) -> BufMut<'_>;
}

impl<T: Element> OwnedBuf for Vec<T> {
    fn buf(&self) -> Buf<'_> {
        Buf::from(self.as_slice())
    }

    fn buf_mut(&mut self) -> BufMut<'_> {
        BufMut::from(self.as_mut_slice())
    }
}

impl<T: Element> OwnedBuf for Box<[T]> {
    fn buf(&self) -> Buf<'_> {
        Buf::from(&self[..])
    }

    fn buf_mut(&mut self) -> BufMut<'_> {
        BufMut::from(&mut self[..])
    }
}

/// Host memory of a type chosen at run time (a gradient bucket), aligned
/// for every [`DType`].
#[derive(Clone, PartialEq, Eq)]
pub struct HostBytes {
    dtype: DType,
    len: usize,
    words: Vec<u64>,
}

impl fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostBytes({} x {})", self.len, self.dtype)
    }
}

impl HostBytes {
    /// `len` zeroed elements of `dtype`.
    pub fn zeroed(dtype: DType, len: usize) -> HostBytes {
        let words = (len * dtype.size()).div_ceil(8);
        HostBytes {
            dtype,
            len,
            words: vec![0; words],
        }
    }

    /// Reuse this memory for `len` elements of `dtype` (contents
    /// unspecified; grows only when needed).
    pub fn reset(&mut self, dtype: DType, len: usize) {
        let words = (len * dtype.size()).div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        self.dtype = dtype;
        self.len = len;
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` when it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements' bytes.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len * self.dtype.size()]
    }

    /// The elements' bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.len * self.dtype.size();
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..n]
    }

    /// A host view.
    pub fn host(&self) -> HostBuf<'_> {
        HostBuf::from_bytes(self.dtype, self.bytes()).expect("whole elements, aligned")
    }

    /// A writable host view.
    pub fn host_mut(&mut self) -> HostBufMut<'_> {
        let dtype = self.dtype;
        HostBufMut::from_bytes(dtype, self.bytes_mut()).expect("whole elements, aligned")
    }
}

impl OwnedBuf for HostBytes {
    fn buf(&self) -> Buf<'_> {
        Buf::Host(self.host())
    }

    fn buf_mut(&mut self) -> BufMut<'_> {
        BufMut::Host(self.host_mut())
    }
}

/// An owned buffer, type-erased.
pub type Owned = Box<dyn OwnedBuf>;

/// One call with the buffers it owns, as [`Communicator::start`](crate::Communicator::start) takes it.
/// The requirements on each call are those of the blocking method of the
/// same name.
#[non_exhaustive]
pub enum Call {
    /// [`Communicator::all_reduce`](crate::Communicator::all_reduce).
    AllReduce {
        /// Reduced in place.
        buf: Owned,
        /// The reduction.
        op: ReduceOp,
    },
    /// [`Communicator::reduce`](crate::Communicator::reduce).
    Reduce {
        /// Reduced in place (the result is guaranteed on `root` only).
        buf: Owned,
        /// The reduction.
        op: ReduceOp,
        /// The rank that gets the result.
        root: usize,
    },
    /// [`Communicator::broadcast`](crate::Communicator::broadcast).
    Broadcast {
        /// `root`'s data, written everywhere else.
        buf: Owned,
        /// The rank whose data is copied.
        root: usize,
    },
    /// [`Communicator::all_gather`](crate::Communicator::all_gather).
    AllGather {
        /// This rank's contribution.
        send: Owned,
        /// Every rank's contributions, rank-major.
        recv: Owned,
    },
    /// [`Communicator::gather`](crate::Communicator::gather).
    Gather {
        /// This rank's contribution.
        send: Owned,
        /// Every rank's contributions, on `root`.
        recv: Option<Owned>,
        /// The rank that gathers.
        root: usize,
    },
    /// [`Communicator::scatter`](crate::Communicator::scatter).
    Scatter {
        /// `root`'s chunks.
        send: Option<Owned>,
        /// This rank's chunk.
        recv: Owned,
        /// The rank that scatters.
        root: usize,
    },
    /// [`Communicator::reduce_scatter`](crate::Communicator::reduce_scatter).
    ReduceScatter {
        /// This rank's full-size contribution.
        send: Owned,
        /// This rank's chunk of the reduction.
        recv: Owned,
        /// The reduction.
        op: ReduceOp,
    },
    /// [`Communicator::all_to_all`](crate::Communicator::all_to_all).
    AllToAll {
        /// Chunk `j` goes to rank `j`.
        send: Owned,
        /// Chunk `i` comes from rank `i`.
        recv: Owned,
    },
    /// [`Communicator::send`](crate::Communicator::send).
    Send {
        /// The message.
        buf: Owned,
        /// The receiving rank.
        dst: usize,
        /// The message tag.
        tag: u32,
    },
    /// [`Communicator::recv`](crate::Communicator::recv).
    Recv {
        /// Where the message lands.
        buf: Owned,
        /// The sending rank.
        src: usize,
        /// The message tag.
        tag: u32,
    },
    /// [`Communicator::barrier`](crate::Communicator::barrier).
    Barrier,
}

impl fmt::Debug for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = self.info();
        write!(f, "Call({} of {} x {})", i.op, i.len, i.dtype)
    }
}

/// The borrowed form of a [`Call`]: the same operation with views of its
/// buffers (what blocking calls pass, and what a started call becomes when
/// it runs).
#[non_exhaustive]
#[derive(Debug)]
#[allow(missing_docs)] // the fields of `Call`, as views
pub enum CallMut<'a> {
    AllReduce {
        buf: BufMut<'a>,
        op: ReduceOp,
    },
    Reduce {
        buf: BufMut<'a>,
        op: ReduceOp,
        root: usize,
    },
    Broadcast {
        buf: BufMut<'a>,
        root: usize,
    },
    AllGather {
        send: Buf<'a>,
        recv: BufMut<'a>,
    },
    Gather {
        send: Buf<'a>,
        recv: Option<BufMut<'a>>,
        root: usize,
    },
    Scatter {
        send: Option<Buf<'a>>,
        recv: BufMut<'a>,
        root: usize,
    },
    ReduceScatter {
        send: Buf<'a>,
        recv: BufMut<'a>,
        op: ReduceOp,
    },
    AllToAll {
        send: Buf<'a>,
        recv: BufMut<'a>,
    },
    Send {
        buf: Buf<'a>,
        dst: usize,
        tag: u32,
    },
    Recv {
        buf: BufMut<'a>,
        src: usize,
        tag: u32,
    },
    Barrier,
}

impl CallMut<'_> {
    /// What this call asks for, as a [`Layer`](crate::Layer) sees it.
    pub fn info(&self) -> CallInfo {
        let host = |op, b: &BufMut<'_>| CallInfo::new(op, b.dtype(), b.len());
        let send = |op, b: &Buf<'_>| CallInfo::new(op, b.dtype(), b.len());
        match self {
            CallMut::AllReduce { buf, op } => host(Op::AllReduce, buf).reduce(*op),
            CallMut::Reduce { buf, op, root } => host(Op::Reduce, buf).reduce(*op).root(*root),
            CallMut::Broadcast { buf, root } => host(Op::Broadcast, buf).root(*root),
            CallMut::AllGather { send: s, .. } => send(Op::AllGather, s),
            CallMut::Gather { send: s, root, .. } => send(Op::Gather, s).root(*root),
            CallMut::Scatter { recv, root, .. } => host(Op::Scatter, recv).root(*root),
            CallMut::ReduceScatter { send: s, op, .. } => send(Op::ReduceScatter, s).reduce(*op),
            CallMut::AllToAll { send: s, .. } => send(Op::AllToAll, s),
            CallMut::Send { buf, dst, tag } => send(Op::Send, buf).p2p(*dst, *tag),
            CallMut::Recv { buf, src, tag } => host(Op::Recv, buf).p2p(*src, *tag),
            CallMut::Barrier => CallInfo::new(Op::Barrier, DType::U8, 0),
        }
    }
}

impl Call {
    /// What this call asks for, as a [`Layer`](crate::Layer) sees it.
    pub fn info(&self) -> CallInfo {
        let one = |op, b: &Owned| CallInfo::new(op, b.buf().dtype(), b.buf().len());
        match self {
            Call::AllReduce { buf, op } => one(Op::AllReduce, buf).reduce(*op),
            Call::Reduce { buf, op, root } => one(Op::Reduce, buf).reduce(*op).root(*root),
            Call::Broadcast { buf, root } => one(Op::Broadcast, buf).root(*root),
            Call::AllGather { send, .. } => one(Op::AllGather, send),
            Call::Gather { send, root, .. } => one(Op::Gather, send).root(*root),
            Call::Scatter { recv, root, .. } => one(Op::Scatter, recv).root(*root),
            Call::ReduceScatter { send, op, .. } => one(Op::ReduceScatter, send).reduce(*op),
            Call::AllToAll { send, .. } => one(Op::AllToAll, send),
            Call::Send { buf, dst, tag } => one(Op::Send, buf).p2p(*dst, *tag),
            Call::Recv { buf, src, tag } => one(Op::Recv, buf).p2p(*src, *tag),
            Call::Barrier => CallInfo::new(Op::Barrier, DType::U8, 0),
        }
    }

    /// Writable views of this call's buffers.
    pub fn views_mut(&mut self) -> CallMut<'_> {
        match self {
            Call::AllReduce { buf, op } => CallMut::AllReduce {
                buf: buf.buf_mut(),
                op: *op,
            },
            Call::Reduce { buf, op, root } => CallMut::Reduce {
                buf: buf.buf_mut(),
                op: *op,
                root: *root,
            },
            Call::Broadcast { buf, root } => CallMut::Broadcast {
                buf: buf.buf_mut(),
                root: *root,
            },
            Call::AllGather { send, recv } => CallMut::AllGather {
                send: send.buf(),
                recv: recv.buf_mut(),
            },
            Call::Gather { send, recv, root } => CallMut::Gather {
                send: send.buf(),
                recv: recv.as_mut().map(|r| r.buf_mut()),
                root: *root,
            },
            Call::Scatter { send, recv, root } => CallMut::Scatter {
                send: send.as_ref().map(|s| s.buf()),
                recv: recv.buf_mut(),
                root: *root,
            },
            Call::ReduceScatter { send, recv, op } => CallMut::ReduceScatter {
                send: send.buf(),
                recv: recv.buf_mut(),
                op: *op,
            },
            Call::AllToAll { send, recv } => CallMut::AllToAll {
                send: send.buf(),
                recv: recv.buf_mut(),
            },
            Call::Send { buf, dst, tag } => CallMut::Send {
                buf: buf.buf(),
                dst: *dst,
                tag: *tag,
            },
            Call::Recv { buf, src, tag } => CallMut::Recv {
                buf: buf.buf_mut(),
                src: *src,
                tag: *tag,
            },
            Call::Barrier => CallMut::Barrier,
        }
    }
}

/// The buffer `b` as the type it was started with.
pub(super) fn back<B: OwnedBuf>(b: Owned) -> Option<B> {
    let any: Box<dyn Any> = b;
    any.downcast::<B>().ok().map(|b| *b)
}

/// What one call asks for, as a layer sees it before forwarding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallInfo {
    /// The operation.
    pub op: Op,
    /// Element type of the call's data (`u8` for barrier and split).
    pub dtype: DType,
    /// Elements this rank contributes (`send` for gathers, the buffer for
    /// in-place calls, `recv` for scatter; 0 for barrier and split).
    pub len: usize,
    /// The root of a rooted call.
    pub root: Option<usize>,
    /// The reduction of a reducing call.
    pub reduce: Option<ReduceOp>,
    /// The peer of a point-to-point call.
    pub peer: Option<usize>,
    /// The tag of a point-to-point call.
    pub tag: Option<u32>,
}

impl CallInfo {
    pub(crate) fn new(op: Op, dtype: DType, len: usize) -> CallInfo {
        CallInfo {
            op,
            dtype,
            len,
            root: None,
            reduce: None,
            peer: None,
            tag: None,
        }
    }

    pub(crate) fn root(self, root: usize) -> CallInfo {
        CallInfo {
            root: Some(root),
            ..self
        }
    }

    pub(crate) fn reduce(self, op: ReduceOp) -> CallInfo {
        CallInfo {
            reduce: Some(op),
            ..self
        }
    }

    pub(crate) fn p2p(self, peer: usize, tag: u32) -> CallInfo {
        CallInfo {
            peer: Some(peer),
            tag: Some(tag),
            ..self
        }
    }

    /// `true` for calls every rank of the group makes (everything but send
    /// and recv).
    pub fn is_collective(&self) -> bool {
        !matches!(self.op, Op::Send | Op::Recv)
    }
}
