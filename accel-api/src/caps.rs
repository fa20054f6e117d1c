use std::collections::BTreeSet;
use std::fmt;

use crate::{DType, DeviceKind, Error, ErrorKind, ReduceOp, Result};

/// An operation of the [`Communicator`](crate::Communicator) trait.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Op {
    /// [`Communicator::all_reduce`](crate::Communicator::all_reduce)
    AllReduce,
    /// [`Communicator::reduce`](crate::Communicator::reduce)
    Reduce,
    /// [`Communicator::broadcast`](crate::Communicator::broadcast)
    Broadcast,
    /// [`Communicator::all_gather`](crate::Communicator::all_gather)
    AllGather,
    /// [`Communicator::gather`](crate::Communicator::gather)
    Gather,
    /// [`Communicator::scatter`](crate::Communicator::scatter)
    Scatter,
    /// [`Communicator::reduce_scatter`](crate::Communicator::reduce_scatter)
    ReduceScatter,
    /// [`Communicator::all_to_all`](crate::Communicator::all_to_all)
    AllToAll,
    /// [`Communicator::send`](crate::Communicator::send)
    Send,
    /// [`Communicator::recv`](crate::Communicator::recv)
    Recv,
    /// [`Communicator::barrier`](crate::Communicator::barrier)
    Barrier,
    /// [`Communicator::split`](crate::Communicator::split)
    Split,
}

impl Op {
    /// Every operation, in declaration order.
    pub const ALL: [Op; 12] = [
        Op::AllReduce,
        Op::Reduce,
        Op::Broadcast,
        Op::AllGather,
        Op::Gather,
        Op::Scatter,
        Op::ReduceScatter,
        Op::AllToAll,
        Op::Send,
        Op::Recv,
        Op::Barrier,
        Op::Split,
    ];

    /// snake_case name (`all_reduce`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::Reduce => "reduce",
            Op::Broadcast => "broadcast",
            Op::AllGather => "all_gather",
            Op::Gather => "gather",
            Op::Scatter => "scatter",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllToAll => "all_to_all",
            Op::Send => "send",
            Op::Recv => "recv",
            Op::Barrier => "barrier",
            Op::Split => "split",
        }
    }

    /// `true` for operations that combine values with a [`ReduceOp`].
    pub const fn is_reduction(self) -> bool {
        matches!(self, Op::AllReduce | Op::Reduce | Op::ReduceScatter)
    }

    /// Stable bit used across the plugin C ABI.
    pub const fn bit(self) -> u32 {
        1 << (self as u32)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a communicator can do, declared up front (OpenDAL's `capability()`).
///
/// The runtime and the conformance suite read this to decide what to run; a
/// call outside it returns [`ErrorKind::Unsupported`]. A backend must never
/// declare something it computes wrongly: declaring less is always allowed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct Capabilities {
    /// Operations implemented.
    pub ops: BTreeSet<Op>,
    /// Element types accepted by the data-movement operations (broadcast,
    /// gathers, scatter, all_to_all, send, recv).
    pub dtypes: BTreeSet<DType>,
    /// Element types accepted by reductions (all_reduce, reduce,
    /// reduce_scatter); a subset of `dtypes`.
    pub reduce_dtypes: BTreeSet<DType>,
    /// Reductions accepted.
    pub reduce_ops: BTreeSet<ReduceOp>,
    /// Device kinds whose memory the communicator takes ([`DeviceKind::Cpu`]
    /// means host buffers).
    pub device_kinds: BTreeSet<DeviceKind>,
    /// `true` when [`Communicator::abort`](crate::Communicator::abort)
    /// interrupts an operation in flight (otherwise it only poisons).
    pub abort_interrupts: bool,
}

impl Capabilities {
    /// Nothing at all; add to it with the builder methods.
    pub fn none() -> Capabilities {
        Capabilities {
            ops: BTreeSet::new(),
            dtypes: BTreeSet::new(),
            reduce_dtypes: BTreeSet::new(),
            reduce_ops: BTreeSet::new(),
            device_kinds: BTreeSet::new(),
            abort_interrupts: false,
        }
    }

    /// Every operation, element type and reduction on host memory.
    pub fn all_host() -> Capabilities {
        Capabilities {
            reduce_ops: ReduceOp::ALL.into_iter().collect(),
            ..Capabilities::none()
                .with_ops(Op::ALL)
                .with_dtypes(DType::ALL)
                .with_reduce_dtypes(DType::ALL)
                .with_device_kinds([DeviceKind::Cpu])
        }
    }

    /// Builder: replace the reduction element types.
    pub fn with_reduce_dtypes(mut self, d: impl IntoIterator<Item = DType>) -> Self {
        self.reduce_dtypes = d.into_iter().collect();
        self
    }

    /// Builder: replace the data-movement element types.
    pub fn with_dtypes(mut self, d: impl IntoIterator<Item = DType>) -> Self {
        self.dtypes = d.into_iter().collect();
        self
    }

    /// Builder: replace the operations.
    pub fn with_ops(mut self, ops: impl IntoIterator<Item = Op>) -> Self {
        self.ops = ops.into_iter().collect();
        self
    }

    /// Builder: replace the accepted device kinds.
    pub fn with_device_kinds(mut self, k: impl IntoIterator<Item = DeviceKind>) -> Self {
        self.device_kinds = k.into_iter().collect();
        self
    }

    /// `true` when `op` is declared.
    pub fn supports(&self, op: Op) -> bool {
        self.ops.contains(&op)
    }

    /// `true` when `op` is declared for `dtype` (and for `reduce` when the
    /// operation is a reduction).
    pub fn supports_call(&self, op: Op, dtype: DType, reduce: Option<ReduceOp>) -> bool {
        self.check(op, dtype, reduce, DeviceKind::Cpu).is_ok()
    }

    /// Check one call against the declaration.
    ///
    /// # Errors
    /// [`ErrorKind::Unsupported`] naming the first thing not declared: the
    /// operation, the element type, the reduction or the device kind.
    pub fn check(
        &self,
        op: Op,
        dtype: DType,
        reduce: Option<ReduceOp>,
        device: DeviceKind,
    ) -> Result<()> {
        let unsupported =
            |what: String| Err(Error::new(ErrorKind::Unsupported, what).with_op(op.name()));
        if !self.ops.contains(&op) {
            return unsupported(format!("operation {op} is not implemented"));
        }
        if !self.device_kinds.contains(&device) {
            return unsupported(format!("{device} memory is not accepted"));
        }
        if op.is_reduction() {
            if !self.reduce_dtypes.contains(&dtype) {
                return unsupported(format!("reductions on {dtype} are not supported"));
            }
            if let Some(r) = reduce {
                if !self.reduce_ops.contains(&r) {
                    return unsupported(format!("reduction {r} is not supported"));
                }
            }
        } else if !matches!(op, Op::Barrier | Op::Split) && !self.dtypes.contains(&dtype) {
            return unsupported(format!("{dtype} buffers are not supported"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_names_the_missing_piece() {
        let caps = Capabilities::all_host().with_reduce_dtypes([DType::F32]);
        assert!(caps
            .check(
                Op::AllReduce,
                DType::F32,
                Some(ReduceOp::Sum),
                DeviceKind::Cpu
            )
            .is_ok());
        let e = caps
            .check(
                Op::AllReduce,
                DType::BF16,
                Some(ReduceOp::Sum),
                DeviceKind::Cpu,
            )
            .unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Unsupported));
        assert!(e.to_string().contains("bf16"), "{e}");
        assert!(caps
            .check(Op::Broadcast, DType::BF16, None, DeviceKind::Cpu)
            .is_ok());
        let e = caps
            .check(Op::Broadcast, DType::F32, None, DeviceKind::Cuda)
            .unwrap_err();
        assert!(e.to_string().contains("cuda"), "{e}");
    }

    #[test]
    fn op_bits_are_distinct() {
        let mut seen = 0u32;
        for op in Op::ALL {
            assert_eq!(seen & op.bit(), 0);
            seen |= op.bit();
        }
    }
}
