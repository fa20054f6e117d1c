//! The StableHLO programs (MLIR text) behind each collective, one module
//! per (program, element type, length, group size); the runtime compiles
//! each once and caches it.
//!
//! Every program takes one 1-D tensor per replica and returns one; replica
//! `i` is rank `i` of the group. Root-based collectives are the all-rank
//! collective plus a static slice (the root is part of the program), so
//! every program is a single XLA collective:
//!
//! | accel call | program | input, output elements |
//! |---|---|---|
//! | all_reduce, reduce | `all_reduce` (the root keeps its output) | `len`, `len` |
//! | all_gather, gather | `all_gather` (the root keeps its output) | `len`, `n * len` |
//! | reduce_scatter | `reduce_scatter` | `n * len`, `len` |
//! | all_to_all | `all_to_all` | `n * len`, `n * len` |
//! | broadcast | `all_gather`, then the root's block | `len`, `len` |
//! | scatter | `all_to_all` (non-roots send zeros), then the block from the root | `n * len`, `len` |

use std::fmt::Write as _;

use accel_api::{DType, ReduceOp};

use crate::error::XlaError;
use crate::ffi::buffer_type;

/// What a compiled program computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Program {
    AllReduce(ReduceOp),
    AllGather,
    ReduceScatter(ReduceOp),
    AllToAll,
    /// All-gather and keep the block of `root`.
    Broadcast {
        root: usize,
    },
    /// All-to-all and keep the block received from `root`.
    Scatter {
        root: usize,
    },
}

/// A program for one shape: its module text and tensor lengths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Module {
    pub(crate) text: String,
    pub(crate) in_len: usize,
    pub(crate) out_len: usize,
}

/// The element types programs are written for: every accel type with an
/// XLA spelling (all eight today).
pub(crate) fn dtypes() -> impl Iterator<Item = DType> {
    DType::ALL.into_iter().filter(|&d| element(d).is_ok())
}

/// The StableHLO element type and `PJRT_Buffer_Type` of `d`.
pub(crate) fn element(d: DType) -> Result<(&'static str, i32), XlaError> {
    Ok(match d {
        DType::F16 => ("f16", buffer_type::F16),
        DType::BF16 => ("bf16", buffer_type::BF16),
        DType::F32 => ("f32", buffer_type::F32),
        DType::F64 => ("f64", buffer_type::F64),
        DType::I8 => ("i8", buffer_type::S8),
        DType::U8 => ("ui8", buffer_type::U8),
        DType::I32 => ("i32", buffer_type::S32),
        DType::I64 => ("i64", buffer_type::S64),
        other => return Err(XlaError::Broken(format!("no XLA type for {other}"))),
    })
}

/// The StableHLO op of a reduction, `None` for `Avg` (the group turns it
/// into a sum and a division) and reductions not written yet.
pub(crate) fn combiner(op: ReduceOp) -> Option<&'static str> {
    match op {
        ReduceOp::Sum => Some("add"),
        ReduceOp::Prod => Some("multiply"),
        ReduceOp::Min => Some("minimum"),
        ReduceOp::Max => Some("maximum"),
        _ => None,
    }
}

fn region(op: ReduceOp, t: &str) -> Result<String, XlaError> {
    let c = combiner(op).ok_or_else(|| XlaError::Broken(format!("no XLA combiner for {op}")))?;
    Ok(format!(
        "({{\n    ^bb0(%a: tensor<{t}>, %b: tensor<{t}>):\n      %r = stablehlo.{c} %a, %b : tensor<{t}>\n      stablehlo.return %r : tensor<{t}>\n    }})"
    ))
}

impl Program {
    /// The module for `len` elements of `dtype` per rank on a group of `n`.
    /// `len` is the per-rank block: the receive length for all_reduce,
    /// broadcast, reduce_scatter and scatter, the send length for
    /// all_gather, and one block of all_to_all.
    ///
    /// # Errors
    /// [`XlaError::Broken`] for an element type or reduction without an XLA
    /// spelling (the capabilities do not declare them).
    pub(crate) fn module(self, dtype: DType, n: usize, len: usize) -> Result<Module, XlaError> {
        let (t, _) = element(dtype)?;
        let groups = format!(
            "replica_groups = dense<[[{}]]> : tensor<1x{n}xi64>",
            (0..n).map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
        );
        let ty = |l: usize| format!("tensor<{l}x{t}>");
        let (in_len, mid_len, out_len) = match self {
            Program::AllReduce(_) => (len, len, len),
            Program::AllGather => (len, n * len, n * len),
            Program::ReduceScatter(_) => (n * len, len, len),
            Program::AllToAll => (n * len, n * len, n * len),
            Program::Broadcast { .. } => (len, n * len, len),
            Program::Scatter { .. } => (n * len, n * len, len),
        };
        let collective = match self {
            Program::AllReduce(op) => format!(
                "\"stablehlo.all_reduce\"(%arg0) {} {{{groups}}}",
                region(op, t)?
            ),
            Program::ReduceScatter(op) => format!(
                "\"stablehlo.reduce_scatter\"(%arg0) {} {{scatter_dimension = 0 : i64, {groups}}}",
                region(op, t)?
            ),
            Program::AllGather | Program::Broadcast { .. } => {
                format!("\"stablehlo.all_gather\"(%arg0) {{all_gather_dim = 0 : i64, {groups}}}")
            }
            Program::AllToAll | Program::Scatter { .. } => format!(
                "\"stablehlo.all_to_all\"(%arg0) {{split_dimension = 0 : i64, concat_dimension = 0 : i64, split_count = {n} : i64, {groups}}}"
            ),
        };
        let mut body = format!(
            "    %0 = {collective} : ({}) -> {}\n",
            ty(in_len),
            ty(mid_len)
        );
        let result = match self {
            Program::Broadcast { root } | Program::Scatter { root } => {
                let _ = writeln!(
                    body,
                    "    %1 = stablehlo.slice %0 [{}:{}] : ({}) -> {}",
                    root * len,
                    (root + 1) * len,
                    ty(mid_len),
                    ty(out_len)
                );
                "%1"
            }
            _ => "%0",
        };
        let text = format!(
            "module @accel_collective {{\n  func.func public @main(%arg0: {}) -> {} {{\n{body}    return {result} : {}\n  }}\n}}\n",
            ty(in_len),
            ty(out_len),
            ty(out_len)
        );
        Ok(Module {
            text,
            in_len,
            out_len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_name_their_shapes_and_groups() {
        let m = Program::AllReduce(ReduceOp::Max)
            .module(DType::U8, 3, 5)
            .unwrap();
        assert!(
            m.text.contains("stablehlo.maximum %a, %b : tensor<ui8>"),
            "{}",
            m.text
        );
        assert!(
            m.text.contains("dense<[[0, 1, 2]]> : tensor<1x3xi64>"),
            "{}",
            m.text
        );
        assert_eq!((m.in_len, m.out_len), (5, 5));
        let m = Program::Scatter { root: 2 }
            .module(DType::F32, 3, 4)
            .unwrap();
        assert!(m.text.contains("[8:12]"), "{}", m.text);
        assert_eq!((m.in_len, m.out_len), (12, 4));
        let m = Program::AllGather.module(DType::BF16, 2, 7).unwrap();
        assert!(
            m.text.contains("(tensor<7xbf16>) -> tensor<14xbf16>"),
            "{}",
            m.text
        );
    }
}
