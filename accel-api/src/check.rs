//! The always-on call check (ADR 0016): before every collective, the ranks
//! of a [`Group`](crate::kit::Group) compare the shape of the call (operation,
//! element type, length, root, reduction) with one tiny exchange through
//! the engine itself, so that a call the engine cannot survive (mismatched
//! lengths read or write past a buffer in MPI and abort Gloo's transport
//! thread; mismatched operations or types give silently wrong answers)
//! never reaches it. A disagreement is an [`ErrorKind::Mismatch`] error on
//! every rank, naming what differs and on which ranks.
//!
//! # The exchange
//!
//! Each rank encodes its call as 9 integers below 2^16 (exact in
//! every integer and floating type: no hash, no false agreement) and the
//! ranks all-gather them (36 bytes per rank in `i32`), so every rank sees
//! every call and names the ranks and values that differ. An all-gather is
//! the cheapest exchange measured: on 2 ranks, 72 bytes, Gloo's ring
//! all-gather takes one step where its all-reduce takes two (best 106-129
//! µs against 213-221 µs), and MPI's 1.1-1.7 µs against 1.8-3.1 µs
//! (docs/benchmarks.md). cpu-gloo's shim runs all-gathers this small on a
//! second mesh in Gloo's synchronous mode instead (one frame per peer, read
//! by the calling thread: about 10 µs best where Gloo's own all-gather takes
//! 75-125 µs). Engines without an all-gather on host memory
//! all-reduce `[d, -d]` with [`ReduceOp::Max`] instead (every rank then
//! holds the maximum and the minimum of each digit; the calls agree exactly
//! when they are equal) and all-gather only after a disagreement, to name
//! the ranks. Engines with neither are not checked (none of accel's
//! backends).
//!
//! # Turning it off
//!
//! `ACCEL_CHECK_CALLS=0` ([`CallCheck::Off`]) skips the exchange. The first
//! collective of a group is always checked, carrying each rank's setting,
//! so ranks that disagree about the setting fail there instead of pairing
//! one rank's check with another rank's collective. With the check off a
//! mismatched call is the user's bug and its effect is the engine's (Gloo
//! aborts the process, MPI's behaviour is undefined).

use std::fmt::Write as _;

use crate::{
    Buf, BufMut, Capabilities, DType, DeviceKind, Error, ErrorKind, HostBuf, HostBufMut,
    MismatchEntry, Op, ReduceOp, Result,
};

/// Whether a [`Group`](crate::kit::Group) compares every collective's shape
/// across ranks before the engine runs it (ADR 0016; the kit's docs,
/// [`kit`](crate::kit), say what an engine sees of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CallCheck {
    /// Check every collective (the default).
    #[default]
    On,
    /// Check only the first collective of each group (which also compares
    /// the setting itself).
    Off,
}

impl CallCheck {
    /// The environment variable read by [`CallCheck::from_env`].
    pub const VARIABLE: &'static str = "ACCEL_CHECK_CALLS";

    /// `1`/`on`/`true`/`yes` or `0`/`off`/`false`/`no` (any case).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] naming [`CallCheck::VARIABLE`] for any
    /// other value.
    pub fn parse(value: &str) -> Result<CallCheck> {
        match value.trim().to_ascii_lowercase().as_str() {
            "1" | "on" | "true" | "yes" => Ok(CallCheck::On),
            "0" | "off" | "false" | "no" => Ok(CallCheck::Off),
            _ => Err(Error::invalid_config(
                Self::VARIABLE,
                value,
                "expected 1 or 0 (on/off, true/false)",
            )
            .with_fix("set ACCEL_CHECK_CALLS=1 (check every collective, the default) or 0")),
        }
    }

    /// The setting in the environment; unset or empty is [`CallCheck::On`].
    ///
    /// # Errors
    /// As [`CallCheck::parse`].
    pub fn from_env() -> Result<CallCheck> {
        match std::env::var(Self::VARIABLE) {
            Ok(v) if !v.trim().is_empty() => CallCheck::parse(&v),
            _ => Ok(CallCheck::On),
        }
    }
}

std::thread_local! {
    /// The setting groups created on this thread take, when set (see
    /// [`CallCheck::scoped`]).
    static SCOPED: std::cell::Cell<Option<CallCheck>> = const { std::cell::Cell::new(None) };
}

impl CallCheck {
    /// Run `f` with `check` as the setting of every [`Group`](crate::kit::Group)
    /// created on this thread during `f` (instead of the environment's).
    /// The plugin boundary uses it: the host's group in front of a plugin
    /// already checks every call, so the group inside the plugin checks
    /// only its first collective.
    pub fn scoped<T>(check: CallCheck, f: impl FnOnce() -> T) -> T {
        let before = SCOPED.with(|s| s.replace(Some(check)));
        struct Restore(Option<CallCheck>);
        impl Drop for Restore {
            fn drop(&mut self) {
                SCOPED.with(|s| s.set(self.0));
            }
        }
        let _restore = Restore(before);
        f()
    }

    /// The setting a new group takes: [`CallCheck::scoped`]'s, else the
    /// environment's, else on (a malformed value keeps the check on;
    /// `accel::state()` reports it).
    pub(crate) fn for_new_group() -> CallCheck {
        SCOPED
            .with(|s| s.get())
            .unwrap_or_else(|| CallCheck::from_env().unwrap_or_default())
    }
}

/// The shape of one collective as the check compares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    pub op: Op,
    pub dtype: DType,
    /// Elements this rank contributes (the per-rank chunk for gathers and
    /// scatters, 0 for barrier and split).
    pub len: usize,
    pub root: Option<usize>,
    pub reduce: Option<ReduceOp>,
}

impl Shape {
    pub fn new(op: Op, dtype: DType, len: usize) -> Shape {
        Shape {
            op,
            dtype,
            len,
            root: None,
            reduce: None,
        }
    }

    pub fn root(mut self, root: usize) -> Shape {
        self.root = Some(root);
        self
    }

    pub fn reduce(mut self, reduce: ReduceOp) -> Shape {
        self.reduce = Some(reduce);
        self
    }
}

/// Integers per rank in the exchange: one head (operation, element type,
/// reduction, root present, setting), four for the length, four for the
/// root, each below 2^16.
pub(crate) const DIGITS: usize = 9;

fn op_index(op: Op) -> u64 {
    Op::ALL.iter().position(|&o| o == op).unwrap_or(15) as u64
}

/// `shape` (with this rank's `setting`) as [`DIGITS`] digits.
pub(crate) fn encode(shape: &Shape, setting: CallCheck) -> [i64; DIGITS] {
    let head = op_index(shape.op)
        | u64::from(shape.dtype.code() & 0xf) << 4
        | u64::from(shape.reduce.map_or(0, |r| r.code()) & 0x7) << 8
        | u64::from(shape.root.is_some()) << 11
        | u64::from(setting == CallCheck::Off) << 12;
    let mut d = [0i64; DIGITS];
    d[0] = head as i64;
    let len = shape.len as u64;
    let root = shape.root.unwrap_or(0) as u64;
    for i in 0..4 {
        d[1 + i] = ((len >> (16 * i)) & 0xffff) as i64;
        d[5 + i] = ((root >> (16 * i)) & 0xffff) as i64;
    }
    d
}

/// One rank's call read back from its digits.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Decoded {
    op: Option<Op>,
    dtype: Option<DType>,
    reduce: Option<ReduceOp>,
    root: Option<u64>,
    len: u64,
    off: bool,
}

fn decode(d: &[i64]) -> Decoded {
    let head = d[0] as u64;
    let word = |at: usize| (0..4).fold(0u64, |acc, i| acc | ((d[at + i] as u64) << (16 * i)));
    Decoded {
        op: Op::ALL.get((head & 0xf) as usize).copied(),
        dtype: DType::from_code(((head >> 4) & 0xf) as u32),
        reduce: ReduceOp::from_code(((head >> 8) & 0x7) as u32),
        root: ((head >> 11) & 1 == 1).then(|| word(5)),
        len: word(1),
        off: (head >> 12) & 1 == 1,
    }
}

impl Decoded {
    fn describe(&self, seq: u64) -> String {
        let mut s = format!(
            "#{seq} {} {} [{}]",
            self.op.map_or("?", Op::name),
            self.dtype.map_or("?", DType::name),
            self.len
        );
        if let Some(r) = self.root {
            let _ = write!(s, " root={r}");
        }
        if let Some(r) = self.reduce {
            let _ = write!(s, " reduce={}", r.name());
        }
        if self.off {
            s.push_str(" (ACCEL_CHECK_CALLS=0)");
        }
        s
    }
}

/// How a group runs the check on its engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// All-gather the digits in this element type.
    Gather(DType),
    /// All-reduce `[d, -d]` with `Max` in this element type (all-gather
    /// only after a disagreement).
    Max(DType),
}

/// Element types exact for every digit and its negation, cheapest first.
const EXACT: [DType; 4] = [DType::I32, DType::I64, DType::F32, DType::F64];

/// The cheapest exchange `caps` allows on host memory, if any.
pub(crate) fn plan(caps: &Capabilities) -> Option<Plan> {
    if !caps.device_kinds.contains(&DeviceKind::Cpu) {
        return None;
    }
    if caps.ops.contains(&Op::AllGather) {
        if let Some(&t) = EXACT.iter().find(|t| caps.dtypes.contains(t)) {
            return Some(Plan::Gather(t));
        }
    }
    if caps.ops.contains(&Op::AllReduce) && caps.reduce_ops.contains(&ReduceOp::Max) {
        if let Some(&t) = EXACT.iter().find(|t| caps.reduce_dtypes.contains(t)) {
            return Some(Plan::Max(t));
        }
    }
    None
}

/// Integers in one of the [`EXACT`] element types, as buffer views.
pub(crate) enum Digits {
    I32(Vec<i32>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Digits {
    /// `values` (each of magnitude below 2^16) as `dtype`; `extra` zeros
    /// follow them.
    pub fn new(dtype: DType, values: &[i64], extra: usize) -> Digits {
        let n = values.len() + extra;
        let v = values.iter().copied().chain(std::iter::repeat(0)).take(n);
        match dtype {
            DType::I64 => Digits::I64(v.collect()),
            DType::F32 => Digits::F32(v.map(|x| x as f32).collect()),
            DType::F64 => Digits::F64(v.map(|x| x as f64).collect()),
            _ => Digits::I32(v.map(|x| x as i32).collect()),
        }
    }

    pub fn buf(&self) -> Buf<'_> {
        Buf::Host(match self {
            Digits::I32(v) => HostBuf::from(&v[..]),
            Digits::I64(v) => HostBuf::from(&v[..]),
            Digits::F32(v) => HostBuf::from(&v[..]),
            Digits::F64(v) => HostBuf::from(&v[..]),
        })
    }

    pub fn buf_mut(&mut self) -> BufMut<'_> {
        BufMut::Host(match self {
            Digits::I32(v) => HostBufMut::from(&mut v[..]),
            Digits::I64(v) => HostBufMut::from(&mut v[..]),
            Digits::F32(v) => HostBufMut::from(&mut v[..]),
            Digits::F64(v) => HostBufMut::from(&mut v[..]),
        })
    }

    pub fn values(&self) -> Vec<i64> {
        match self {
            Digits::I32(v) => v.iter().map(|&x| i64::from(x)).collect(),
            Digits::I64(v) => v.clone(),
            Digits::F32(v) => v.iter().map(|&x| x as i64).collect(),
            Digits::F64(v) => v.iter().map(|&x| x as i64).collect(),
        }
    }
}

/// `[d, -d]`, the input of the `Max` exchange.
pub(crate) fn with_negation(d: &[i64; DIGITS]) -> Vec<i64> {
    d.iter().copied().chain(d.iter().map(|x| -x)).collect()
}

/// `true` when the result of the `Max` exchange says every rank passed the
/// same digits (the maximum of each digit equals its minimum).
pub(crate) fn agreed(maxed: &[i64]) -> bool {
    maxed.len() == 2 * DIGITS && (0..DIGITS).all(|i| maxed[i] == -maxed[DIGITS + i])
}

/// `true` when every rank's digits in `all` (rank-major) are equal.
pub(crate) fn all_equal(all: &[i64]) -> bool {
    all.chunks(DIGITS).all(|c| c == &all[..DIGITS])
}

/// The [`ErrorKind::Mismatch`] error for collective `seq` from every rank's
/// digits (`all`, rank-major).
pub(crate) fn mismatch(seq: u64, all: &[i64]) -> Error {
    let calls: Vec<Decoded> = all.chunks(DIGITS).map(decode).collect();
    let table = calls
        .iter()
        .enumerate()
        .map(|(rank, c)| MismatchEntry {
            rank,
            call: Some(c.describe(seq)),
        })
        .collect();
    let mut differs = Vec::new();
    let mut field = |name: &str, value: &dyn Fn(&Decoded) -> String| {
        let values: Vec<String> = calls.iter().map(value).collect();
        if values.iter().any(|v| v != &values[0]) {
            differs.push(format!("{name} ({})", by_value(&values)));
        }
    };
    field("operation", &|c| c.op.map_or("?", Op::name).to_string());
    field("element type", &|c| {
        c.dtype.map_or("?", DType::name).to_string()
    });
    field("length", &|c| c.len.to_string());
    field("root", &|c| c.root.map_or("-".into(), |r| r.to_string()));
    field("reduction", &|c| {
        c.reduce.map_or("-", ReduceOp::name).to_string()
    });
    field("ACCEL_CHECK_CALLS", &|c| {
        if c.off { "0" } else { "1" }.to_string()
    });
    disagreement(seq, table, &differs, "")
}

/// The [`ErrorKind::Mismatch`] error of collective `seq`: `fields` differ.
fn disagreement(seq: u64, table: Vec<MismatchEntry>, fields: &[String], note: &str) -> Error {
    Error::new(
        ErrorKind::Mismatch { table },
        format!(
            "ranks disagree on collective #{seq}: {} differ{}{note}",
            fields.join(", "),
            if fields.len() == 1 { "s" } else { "" }
        ),
    )
    .with_fix(
        "make every rank call the same collectives in the same order with the same element type, length, root and reduction (ACCEL_DEBUG=1 also checks through the store, with a per-rank table)",
    )
}

/// The [`ErrorKind::Mismatch`] error when the `Max` exchange disagreed
/// (`maxed`: its result): the fields that differ, this rank's row; the
/// engine has no all-gather to name the other ranks.
pub(crate) fn mismatch_fields(
    seq: u64,
    rank: usize,
    world: usize,
    mine: &[i64; DIGITS],
    maxed: &[i64],
) -> Error {
    let differs =
        |at: std::ops::Range<usize>| at.into_iter().any(|i| maxed[i] != -maxed[DIGITS + i]);
    // Head bits: op 0-3, dtype 4-7, reduction 8-10, root present 11, setting 12.
    let head = (maxed[0] as u64) ^ ((-maxed[DIGITS]) as u64);
    let mut fields = Vec::new();
    for (name, mask) in [
        ("operation", 0xf),
        ("element type", 0xf0),
        ("reduction", 0x700),
        ("root", 0x800),
        ("ACCEL_CHECK_CALLS", 0x1000),
    ] {
        if head & mask != 0 {
            fields.push(name.to_string());
        }
    }
    if differs(1..5) {
        fields.push("length".into());
    }
    if differs(5..9) && !fields.iter().any(|f| f == "root") {
        fields.push("root".into());
    }
    let table = (0..world)
        .map(|r| MismatchEntry {
            rank: r,
            call: (r == rank).then(|| decode(mine).describe(seq)),
        })
        .collect();
    disagreement(
        seq,
        table,
        &fields,
        " (this engine has no all-gather to name the ranks)",
    )
}

/// `1000 on rank 0; 100000 on ranks 1, 2`.
fn by_value(values: &[String]) -> String {
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (rank, v) in values.iter().enumerate() {
        match groups.iter_mut().find(|(x, _)| x == v) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((v, vec![rank])),
        }
    }
    groups
        .iter()
        .map(|(v, ranks)| {
            let r: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
            let word = if ranks.len() == 1 { "rank" } else { "ranks" };
            format!("{v} on {word} {}", r.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape::new(Op::AllReduce, DType::F32, 100_000).reduce(ReduceOp::Sum)
    }

    #[test]
    fn digits_round_trip_and_fit_every_exact_type() {
        let s = Shape::new(Op::Gather, DType::I64, usize::MAX).root(70_000);
        let d = encode(&s, CallCheck::Off);
        assert!(d.iter().all(|&x| (0..1 << 16).contains(&x)), "{d:?}");
        let back = decode(&d);
        assert_eq!(back.op, Some(Op::Gather));
        assert_eq!(back.dtype, Some(DType::I64));
        assert_eq!(back.len, usize::MAX as u64);
        assert_eq!(back.root, Some(70_000));
        assert!(back.off);
        for t in EXACT {
            let v = with_negation(&d);
            assert_eq!(Digits::new(t, &v, 0).values(), v, "{t}");
        }
    }

    #[test]
    fn every_field_changes_the_digits() {
        let base = encode(&shape(), CallCheck::On);
        let variants = [
            Shape::new(Op::Reduce, DType::F32, 100_000).reduce(ReduceOp::Sum),
            Shape::new(Op::AllReduce, DType::I32, 100_000).reduce(ReduceOp::Sum),
            Shape::new(Op::AllReduce, DType::F32, 100_001).reduce(ReduceOp::Sum),
            Shape::new(Op::AllReduce, DType::F32, 100_000).reduce(ReduceOp::Max),
            Shape::new(Op::Broadcast, DType::F32, 100_000).root(0),
        ];
        for v in variants {
            assert_ne!(encode(&v, CallCheck::On), base, "{v:?}");
        }
        assert_ne!(encode(&shape(), CallCheck::Off), base);
        let b0 = encode(
            &Shape::new(Op::Broadcast, DType::U8, 4).root(0),
            CallCheck::On,
        );
        let b1 = encode(
            &Shape::new(Op::Broadcast, DType::U8, 4).root(1),
            CallCheck::On,
        );
        assert_ne!(b0, b1);
    }

    /// What the `Max` all-reduce computes, elementwise over the ranks.
    fn maxed(ranks: &[[i64; DIGITS]]) -> Vec<i64> {
        let v: Vec<Vec<i64>> = ranks.iter().map(with_negation).collect();
        (0..2 * DIGITS)
            .map(|i| v.iter().map(|r| r[i]).max().unwrap())
            .collect()
    }

    #[test]
    fn the_max_exchange_agrees_exactly_when_the_calls_do() {
        let a = encode(&shape(), CallCheck::On);
        assert!(agreed(&maxed(&[a, a, a])));
        let long = encode(
            &Shape::new(Op::AllReduce, DType::F32, 100_000 + (1 << 16)).reduce(ReduceOp::Sum),
            CallCheck::On,
        );
        assert!(!agreed(&maxed(&[a, long])));
        assert!(!agreed(&maxed(&[a, a, encode(&shape(), CallCheck::Off)])));
        assert!(all_equal(&[a, a].concat()));
        assert!(!all_equal(&[a, long].concat()));
    }

    #[test]
    fn the_mismatch_names_what_differs_and_the_ranks() {
        let a = encode(&shape(), CallCheck::On);
        let b = encode(
            &Shape::new(Op::AllReduce, DType::F32, 1000).reduce(ReduceOp::Max),
            CallCheck::On,
        );
        let e = mismatch(41, &[a, b, a].concat());
        let s = e.to_string();
        assert!(
            s.contains("length (100000 on ranks 0, 2; 1000 on rank 1)"),
            "{s}"
        );
        assert!(
            s.contains("reduction (sum on ranks 0, 2; max on rank 1)"),
            "{s}"
        );
        assert!(!s.contains("element type ("), "{s}");
        assert!(
            s.contains("rank 1: #41 all_reduce f32 [1000] reduce=max"),
            "{s}"
        );
        let ErrorKind::Mismatch { table } = e.kind() else {
            panic!("{e}")
        };
        assert_eq!(table.len(), 3);
        assert!(e.is_fatal_for_group());
    }

    #[test]
    fn the_max_exchange_alone_names_the_fields() {
        let a = encode(&shape(), CallCheck::On);
        let b = encode(
            &Shape::new(Op::AllReduce, DType::F32, 100_000 + (1 << 16)).reduce(ReduceOp::Max),
            CallCheck::On,
        );
        let e = mismatch_fields(3, 1, 2, &b, &maxed(&[a, b]));
        let s = e.to_string();
        assert!(s.contains("#3: reduction, length differ"), "{s}");
        assert!(s.contains("rank 0: <no report>"), "{s}");
        assert!(
            s.contains("rank 1: #3 all_reduce f32 [165536] reduce=max"),
            "{s}"
        );
    }

    #[test]
    fn plans_follow_the_capabilities() {
        let all = Capabilities::all_host();
        assert_eq!(plan(&all), Some(Plan::Gather(DType::I32)));
        let mut c = all.clone().with_reduce_dtypes([DType::F32]);
        c.ops.remove(&Op::AllGather);
        assert_eq!(plan(&c), Some(Plan::Max(DType::F32)));
        c.reduce_ops.remove(&ReduceOp::Max);
        assert_eq!(plan(&c), None);
        let mut c = all.with_dtypes([DType::F16, DType::F64]);
        c.ops.remove(&Op::AllReduce);
        assert_eq!(plan(&c), Some(Plan::Gather(DType::F64)));
        assert_eq!(plan(&Capabilities::none()), None);
    }

    #[test]
    fn a_scoped_setting_applies_inside_only() {
        let outside = CallCheck::for_new_group();
        let inside = CallCheck::scoped(CallCheck::Off, CallCheck::for_new_group);
        assert_eq!(inside, CallCheck::Off);
        assert_eq!(CallCheck::for_new_group(), outside);
    }

    #[test]
    fn the_setting_parses_and_names_its_variable() {
        assert_eq!(CallCheck::parse("0").unwrap(), CallCheck::Off);
        assert_eq!(CallCheck::parse(" ON ").unwrap(), CallCheck::On);
        let e = CallCheck::parse("sometimes").unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidConfig);
        assert!(e.to_string().contains("ACCEL_CHECK_CALLS"), "{e}");
    }
}
