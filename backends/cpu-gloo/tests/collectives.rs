//! Every collective, for every declared element type and reduction, at
//! world sizes 1 to 4, against an oracle computed here from every rank's
//! inputs. Sizes include 0, 1, primes and lengths that are not multiples of
//! the world size wherever the operation allows them.

mod common;

use std::fmt::Debug;
use std::time::Duration;

use accel_api::{
    bf16, f16, Buf, BufMut, Communicator, CommunicatorExt, DType, Element, ErrorKind, Op, ReduceOp,
};

const TIMEOUT: Duration = Duration::from_secs(10);
const DEADLINE: Duration = Duration::from_secs(50);

/// Inputs and the reference result of a reduction for one element type.
trait TestElem: Element + Copy + PartialEq + Debug {
    /// Rank `rank`'s input at index `i` for reduction `op`.
    fn val(rank: usize, i: usize, op: ReduceOp) -> Self;
    /// The reduction of `vals` (one per rank) with `op` over `n` ranks.
    fn oracle(op: ReduceOp, vals: &[Self], n: usize) -> Self;
    /// `got` is an acceptable answer for `want`.
    fn close(got: Self, want: Self) -> bool;
}

macro_rules! int_elem {
    ($t:ty, $signed:expr) => {
        impl TestElem for $t {
            fn val(rank: usize, i: usize, op: ReduceOp) -> Self {
                if op == ReduceOp::Prod {
                    let m = 1 + ((rank + i) % 2) as i128;
                    let neg = $signed && (rank + 2 * i) % 3 == 0;
                    (if neg { -m } else { m }) as $t
                } else {
                    let v = ((rank * 7 + i * 3) % 11) as i128;
                    (if $signed { v - 5 } else { v }) as $t
                }
            }
            fn oracle(op: ReduceOp, vals: &[Self], n: usize) -> Self {
                let it = vals.iter().map(|&v| v as i128);
                let r: i128 = match op {
                    ReduceOp::Sum => it.sum(),
                    ReduceOp::Prod => it.product(),
                    ReduceOp::Min => it.min().unwrap(),
                    ReduceOp::Max => it.max().unwrap(),
                    // Integer average truncates toward zero.
                    ReduceOp::Avg => it.sum::<i128>() / n as i128,
                    _ => unreachable!(),
                };
                r as $t
            }
            fn close(got: Self, want: Self) -> bool {
                got == want
            }
        }
    };
}

int_elem!(i8, true);
int_elem!(u8, false);
int_elem!(i32, true);
int_elem!(i64, true);

macro_rules! float_elem {
    ($t:ty, $tol:expr) => {
        impl TestElem for $t {
            fn val(rank: usize, i: usize, op: ReduceOp) -> Self {
                let v = if op == ReduceOp::Prod {
                    [1.0, 2.0, -0.5][(rank + i) % 3]
                } else {
                    ((rank * 7 + i * 3) % 11) as f64 * 0.5 - 2.5
                };
                <$t as Element>::from_f64(v)
            }
            fn oracle(op: ReduceOp, vals: &[Self], n: usize) -> Self {
                let it = vals.iter().map(|v| v.to_f64());
                let r = match op {
                    ReduceOp::Sum => it.sum(),
                    ReduceOp::Prod => it.product(),
                    ReduceOp::Min => it.fold(f64::INFINITY, f64::min),
                    ReduceOp::Max => it.fold(f64::NEG_INFINITY, f64::max),
                    ReduceOp::Avg => it.sum::<f64>() / n as f64,
                    _ => unreachable!(),
                };
                <$t as Element>::from_f64(r)
            }
            fn close(got: Self, want: Self) -> bool {
                let (g, w) = (got.to_f64(), want.to_f64());
                (g - w).abs() <= $tol * w.abs().max(1.0)
            }
        }
    };
}

float_elem!(f16, 2e-3);
float_elem!(f32, 1e-6);
float_elem!(f64, 1e-12);

/// Data-movement payload: exact in every element type, bf16 included.
fn data<T: Element>(rank: usize, i: usize) -> T {
    T::from_f64(((rank * 31 + i * 7) % 50) as f64)
}

fn data_vec<T: Element>(rank: usize, len: usize) -> Vec<T> {
    (0..len).map(|i| data(rank, i)).collect()
}

fn assert_close<T: TestElem>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            T::close(*g, *w),
            "{what}: element {i}: got {g:?}, want {w:?}"
        );
    }
}

fn reductions<T: TestElem>(c: &dyn Communicator) {
    let (n, rank, dt) = (c.world_size(), c.rank(), T::DTYPE);
    let caps = c.capabilities().clone();
    let oracle = |op: ReduceOp, i: usize| {
        let vals: Vec<T> = (0..n).map(|q| T::val(q, i, op)).collect();
        T::oracle(op, &vals, n)
    };
    for op in ReduceOp::ALL {
        if !caps.supports_call(Op::AllReduce, dt, Some(op)) {
            let mut v = vec![T::val(rank, 0, op)];
            let e = c.all_reduce(BufMut::from(&mut v), op).unwrap_err();
            assert_eq!(e.kind(), &ErrorKind::Unsupported, "{e}");
            continue;
        }
        for len in [0usize, 1, 2, 13, 67] {
            let mut v: Vec<T> = (0..len).map(|i| T::val(rank, i, op)).collect();
            c.all_reduce(BufMut::from(&mut v), op)
                .unwrap_or_else(|e| panic!("all_reduce {dt} {op} [{len}]: {e}"));
            let want: Vec<T> = (0..len).map(|i| oracle(op, i)).collect();
            assert_close(
                &v,
                &want,
                &format!("rank {rank} all_reduce {dt} {op} [{len}]"),
            );
        }
        for (len, root) in [(0usize, 0usize), (5, n - 1), (13, n / 2)] {
            let mut v: Vec<T> = (0..len).map(|i| T::val(rank, i, op)).collect();
            c.reduce(BufMut::from(&mut v), op, root)
                .unwrap_or_else(|e| panic!("reduce {dt} {op} [{len}] root {root}: {e}"));
            if rank == root {
                let want: Vec<T> = (0..len).map(|i| oracle(op, i)).collect();
                assert_close(&v, &want, &format!("reduce {dt} {op} [{len}] root {root}"));
            }
        }
        for chunk in [0usize, 1, 3] {
            let send: Vec<T> = (0..chunk * n).map(|i| T::val(rank, i, op)).collect();
            let mut recv = vec![T::zeroed(); chunk];
            c.reduce_scatter(Buf::from(&send), BufMut::from(&mut recv), op)
                .unwrap_or_else(|e| panic!("reduce_scatter {dt} {op} chunk {chunk}: {e}"));
            let want: Vec<T> = (0..chunk).map(|i| oracle(op, rank * chunk + i)).collect();
            assert_close(
                &recv,
                &want,
                &format!("rank {rank} reduce_scatter {dt} {op} chunk {chunk}"),
            );
        }
    }
}

fn movement<T: Element + Debug>(c: &dyn Communicator) {
    let (n, rank, dt) = (c.world_size(), c.rank(), T::DTYPE);
    assert!(c.capabilities().supports_call(Op::Broadcast, dt, None));
    for root in 0..n {
        for len in [0usize, 1, 13] {
            let mut v = if rank == root {
                data_vec::<T>(root, len)
            } else {
                vec![T::zeroed(); len]
            };
            c.broadcast(BufMut::from(&mut v), root)
                .unwrap_or_else(|e| panic!("broadcast {dt} root {root}: {e}"));
            assert_eq!(
                v,
                data_vec::<T>(root, len),
                "broadcast {dt} root {root} [{len}]"
            );
        }
    }
    for len in [0usize, 1, 5] {
        let got = c.all_gather_vec(&data_vec::<T>(rank, len)).unwrap();
        let want: Vec<T> = (0..n).flat_map(|q| data_vec::<T>(q, len)).collect();
        assert_eq!(got, want, "all_gather {dt} [{len}]");
    }
    for root in 0..n {
        for len in [0usize, 3] {
            let got = c.gather_vec(&data_vec::<T>(rank, len), root).unwrap();
            if rank == root {
                let want: Vec<T> = (0..n).flat_map(|q| data_vec::<T>(q, len)).collect();
                assert_eq!(got, Some(want), "gather {dt} root {root} [{len}]");
            } else {
                assert_eq!(got, None);
            }
        }
        for chunk in [0usize, 2] {
            let all = data_vec::<T>(root, chunk * n);
            let send = (rank == root).then_some(&all[..]);
            let got = c.scatter_vec(send, chunk, root).unwrap();
            assert_eq!(
                got,
                all[rank * chunk..(rank + 1) * chunk].to_vec(),
                "scatter {dt} root {root} chunk {chunk}"
            );
        }
    }
    for chunk in [0usize, 1, 3] {
        let send = data_vec::<T>(rank, chunk * n);
        let got = c.all_to_all_vec(&send).unwrap();
        let want: Vec<T> = (0..n)
            .flat_map(|q| data_vec::<T>(q, chunk * n)[rank * chunk..(rank + 1) * chunk].to_vec())
            .collect();
        assert_eq!(got, want, "all_to_all {dt} chunk {chunk}");
    }
    // Point to point: rank 0 talks to everyone, everyone answers.
    for len in [0usize, 1, 17] {
        if rank == 0 {
            for q in 1..n {
                c.send_slice(&data_vec::<T>(0, len), q, q as u32).unwrap();
            }
            for q in 1..n {
                let mut got = vec![T::zeroed(); len];
                c.recv_slice(&mut got, q, 100 + q as u32).unwrap();
                assert_eq!(got, data_vec::<T>(q, len), "recv {dt} from {q}");
            }
        } else {
            let mut got = vec![T::zeroed(); len];
            c.recv_slice(&mut got, 0, rank as u32).unwrap();
            assert_eq!(got, data_vec::<T>(0, len), "recv {dt} from 0");
            c.send_slice(&data_vec::<T>(rank, len), 0, 100 + rank as u32)
                .unwrap();
        }
        // To self: buffered, so send first then receive.
        c.send_slice(&data_vec::<T>(rank, len), rank, 7).unwrap();
        c.send_slice(&data_vec::<T>(rank + 1, len), rank, 7)
            .unwrap();
        let mut got = vec![T::zeroed(); len];
        c.recv_slice(&mut got, rank, 7).unwrap();
        assert_eq!(got, data_vec::<T>(rank, len), "self message order");
        c.recv_slice(&mut got, rank, 7).unwrap();
        assert_eq!(got, data_vec::<T>(rank + 1, len), "self message order");
    }
}

fn mismatched_receives_are_errors(c: &dyn Communicator) {
    let (n, rank) = (c.world_size(), c.rank());
    if n < 2 {
        return;
    }
    if rank == 0 {
        c.send_slice(&[1.0f32, 2.0, 3.0], 1, 77).unwrap();
        c.send_slice(&[5i32, 6], 1, 78).unwrap();
        c.send_slice(&[9i64], 1, 79).unwrap();
    } else if rank == 1 {
        let mut two = [0f32; 2];
        let e = c.recv_slice(&mut two, 0, 77).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("3 f32 elements"), "{e}");
        // Same byte count, other element type.
        let mut one = [0i64; 1];
        let e = c.recv_slice(&mut one, 0, 78).unwrap_err();
        assert!(e.to_string().contains("2 i32 elements"), "{e}");
        // The connection is still in step.
        c.recv_slice(&mut one, 0, 79).unwrap();
        assert_eq!(one, [9]);
    }
    c.barrier().unwrap();
}

fn bad_arguments_fail_before_communicating(c: &dyn Communicator) {
    let n = c.world_size();
    let e = c.broadcast_slice(&mut [1u8], n).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
    assert!(e.to_string().contains(&format!("root {n}")), "{e}");
    assert!(e.to_string().contains("cpu-gloo"), "{e}");
    let mut out = vec![0f32; n + 1];
    let e = c
        .all_gather(Buf::from(&[1.0f32][..]), BufMut::from(&mut out))
        .unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
    let e = c.send_slice(&[1u8], n + 3, 0).unwrap_err();
    assert!(e.to_string().contains("destination"), "{e}");
    let mut v = vec![bf16::ONE; 2];
    let e = c.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Unsupported);
    assert!(e.to_string().contains("bf16"), "{e}");
    if n > 1 {
        let e = c.all_to_all_vec(&vec![1u8; n + 1]).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
    }
    // Nothing above touched Gloo: the group still works.
    c.barrier().unwrap();
}

fn everything(world: usize) {
    common::run_ranks(world, TIMEOUT, DEADLINE, move |_rank, comm| {
        let c = &*comm;
        assert_eq!(c.backend_name(), "cpu-gloo");
        assert_eq!(c.world_size(), world);
        let caps = c.capabilities();
        let reduce: Vec<DType> = caps.reduce_dtypes.iter().copied().collect();
        assert_eq!(
            reduce,
            vec![
                DType::F16,
                DType::F32,
                DType::F64,
                DType::I8,
                DType::U8,
                DType::I32,
                DType::I64
            ]
        );
        assert_eq!(caps.dtypes.len(), DType::ALL.len());
        reductions::<f16>(c);
        reductions::<f32>(c);
        reductions::<f64>(c);
        reductions::<i8>(c);
        reductions::<u8>(c);
        reductions::<i32>(c);
        reductions::<i64>(c);
        movement::<f16>(c);
        movement::<bf16>(c);
        movement::<f32>(c);
        movement::<f64>(c);
        movement::<i8>(c);
        movement::<u8>(c);
        movement::<i32>(c);
        movement::<i64>(c);
        mismatched_receives_are_errors(c);
        bad_arguments_fail_before_communicating(c);
        for _ in 0..3 {
            c.barrier().unwrap();
        }
    });
}

#[test]
fn world_of_1() {
    everything(1);
}

#[test]
fn world_of_2() {
    everything(2);
}

#[test]
fn world_of_3() {
    everything(3);
}

#[test]
fn world_of_4() {
    everything(4);
}

#[test]
fn f16_sums_round_like_ieee_half() {
    // 2048 + 1 is not a half (spacing 2 there): each pairwise sum rounds
    // to nearest even, as IEEE half addition does.
    common::run_ranks(2, TIMEOUT, DEADLINE, |rank, c| {
        let mut v = vec![
            if rank == 0 {
                f16::from_f32(2048.0)
            } else {
                f16::from_f32(1.0)
            },
            f16::from_f32(0.1),
        ];
        c.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v[0], f16::from_f32(2048.0) + f16::from_f32(1.0));
        assert_eq!(v[1], f16::from_f32(0.1) + f16::from_f32(0.1));
        let mut m = vec![f16::from_f32(rank as f32 - 0.5); 3];
        c.all_reduce_slice(&mut m, ReduceOp::Max).unwrap();
        assert_eq!(m, vec![f16::from_f32(0.5); 3]);
    });
}
