//! Every collective on 1, 2, 3 and 4 rank threads of this process, for
//! every element type, at one element and at primes, against a host oracle.
//! Inputs are small integers, so every result is exact in every type (sums
//! of at most 4 values in -4..=4, products of 1s and 2s).

mod common;

use std::time::Duration;

use accel_api::{
    bf16, f16, Buf, BufMut, Communicator, CommunicatorExt, DType, HostBuf, HostBufMut, ReduceOp,
};
use accel_backend_xla::__test::XlaCommunicator;

const TIMEOUT: Duration = Duration::from_secs(60);
const LENS: [usize; 2] = [1, 7];

/// The bytes of `values` as `dtype` (each value is exact in every type).
fn encode(dtype: DType, values: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    for &v in values {
        match dtype {
            DType::F16 => out.extend(f16::from_f64(v).to_le_bytes()),
            DType::BF16 => out.extend(bf16::from_f64(v).to_le_bytes()),
            DType::F32 => out.extend((v as f32).to_le_bytes()),
            DType::F64 => out.extend(v.to_le_bytes()),
            DType::I8 => out.extend((v as i8).to_le_bytes()),
            DType::U8 => out.extend((v as u8).to_le_bytes()),
            DType::I32 => out.extend((v as i32).to_le_bytes()),
            DType::I64 => out.extend((v as i64).to_le_bytes()),
            other => panic!("no encoding for {other}"),
        }
    }
    out
}

/// Rank `r`'s `i`-th input: -4..=4 (0..=8 for u8), or 1 and 2 for
/// products.
fn value(dtype: DType, op: Option<ReduceOp>, r: usize, i: usize) -> f64 {
    if op == Some(ReduceOp::Prod) {
        return 1.0 + ((r + i) % 2) as f64;
    }
    let v = ((r * 7 + i * 3) % 9) as f64;
    if dtype == DType::U8 {
        v
    } else {
        v - 4.0
    }
}

fn inputs(dtype: DType, op: Option<ReduceOp>, n: usize, len: usize) -> Vec<Vec<f64>> {
    (0..n)
        .map(|r| (0..len).map(|i| value(dtype, op, r, i)).collect())
        .collect()
}

fn combine(op: ReduceOp, xs: impl Iterator<Item = f64>) -> f64 {
    let xs: Vec<f64> = xs.collect();
    match op {
        ReduceOp::Sum => xs.iter().sum(),
        ReduceOp::Prod => xs.iter().product(),
        ReduceOp::Min => xs.iter().copied().fold(f64::INFINITY, f64::min),
        ReduceOp::Max => xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        _ => unreachable!("the oracle does not average"),
    }
}

fn reduced(op: ReduceOp, data: &[Vec<f64>]) -> Vec<f64> {
    (0..data[0].len())
        .map(|i| combine(op, data.iter().map(|d| d[i])))
        .collect()
}

/// `bytes` as a host input of `dtype`.
fn inp(dtype: DType, bytes: &[u8]) -> Buf<'_> {
    Buf::Host(HostBuf::from_bytes(dtype, bytes).unwrap())
}

/// `bytes` as a host output of `dtype`.
fn out(dtype: DType, bytes: &mut [u8]) -> BufMut<'_> {
    BufMut::Host(HostBufMut::from_bytes(dtype, bytes).unwrap())
}

/// Run one check on `n` rank threads: `f(rank, comm)` returns what the
/// rank got and what it expected.
fn check(n: usize, what: &str, f: impl Fn(usize, &XlaCommunicator) -> (Vec<u8>, Vec<u8>) + Sync) {
    for (rank, r) in common::on_ranks(n, TIMEOUT, f).into_iter().enumerate() {
        let (got, want) = r.unwrap_or_else(|e| panic!("{what} n={n} rank {rank}: {e}"));
        assert_eq!(got, want, "{what} n={n} rank {rank}");
    }
}

const REDUCE_OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max];

fn reductions(n: usize, dtype: DType, len: usize) {
    for op in REDUCE_OPS {
        let data = inputs(dtype, Some(op), n, len);
        let want = encode(dtype, &reduced(op, &data));
        let what = format!("all_reduce {op} {dtype} x{len}");
        check(n, &what, |r, c| {
            let mut b = encode(dtype, &data[r]);
            c.all_reduce(out(dtype, &mut b), op).unwrap();
            (b, want.clone())
        });
        let root = n - 1;
        let what = format!("reduce {op} {dtype} x{len} root {root}");
        check(n, &what, |r, c| {
            let mut b = encode(dtype, &data[r]);
            c.reduce(out(dtype, &mut b), op, root).unwrap();
            if r == root {
                (b, want.clone())
            } else {
                (Vec::new(), Vec::new())
            }
        });
        // reduce_scatter: every rank sends n blocks of len.
        let data = inputs(dtype, Some(op), n, n * len);
        let full = reduced(op, &data);
        let what = format!("reduce_scatter {op} {dtype} x{len}");
        check(n, &what, |r, c| {
            let send = encode(dtype, &data[r]);
            let mut recv = encode(dtype, &vec![0.0; len]);
            c.reduce_scatter(inp(dtype, &send), out(dtype, &mut recv), op)
                .unwrap();
            (recv, encode(dtype, &full[r * len..(r + 1) * len]))
        });
    }
}

fn data_movement(n: usize, dtype: DType, len: usize) {
    let data = inputs(dtype, None, n, len);
    let root = n / 2;
    check(n, &format!("broadcast {dtype} x{len}"), |r, c| {
        let mut b = encode(dtype, &data[r]);
        c.broadcast(out(dtype, &mut b), root).unwrap();
        (b, encode(dtype, &data[root]))
    });
    let all: Vec<f64> = data.concat();
    check(n, &format!("all_gather {dtype} x{len}"), |r, c| {
        let send = encode(dtype, &data[r]);
        let mut recv = vec![0u8; n * send.len()];
        c.all_gather(inp(dtype, &send), out(dtype, &mut recv))
            .unwrap();
        (recv, encode(dtype, &all))
    });
    check(n, &format!("gather {dtype} x{len}"), |r, c| {
        let send = encode(dtype, &data[r]);
        let mut recv = vec![0u8; n * send.len()];
        let dst = (r == root).then(|| out(dtype, &mut recv));
        c.gather(inp(dtype, &send), dst, root).unwrap();
        if r == root {
            (recv, encode(dtype, &all))
        } else {
            (Vec::new(), Vec::new())
        }
    });
    // scatter and all_to_all: every rank holds n blocks of len.
    let blocks = inputs(dtype, None, n, n * len);
    check(n, &format!("scatter {dtype} x{len}"), |r, c| {
        let send = encode(dtype, &blocks[r]);
        let mut recv = vec![0u8; len * dtype.size()];
        let src = (r == root).then(|| inp(dtype, &send));
        c.scatter(src, out(dtype, &mut recv), root).unwrap();
        (recv, encode(dtype, &blocks[root][r * len..(r + 1) * len]))
    });
    check(n, &format!("all_to_all {dtype} x{len}"), |r, c| {
        let send = encode(dtype, &blocks[r]);
        let mut recv = vec![0u8; send.len()];
        c.all_to_all(inp(dtype, &send), out(dtype, &mut recv))
            .unwrap();
        let want: Vec<f64> = (0..n)
            .flat_map(|j| blocks[j][r * len..(r + 1) * len].to_vec())
            .collect();
        (recv, encode(dtype, &want))
    });
    // send/recv around the ring (to self when n == 1).
    check(n, &format!("send/recv {dtype} x{len}"), |r, c| {
        let send = encode(dtype, &data[r]);
        c.send(inp(dtype, &send), (r + 1) % n, 7).unwrap();
        let mut recv = vec![0u8; send.len()];
        let from = (r + n - 1) % n;
        c.recv(out(dtype, &mut recv), from, 7).unwrap();
        (recv, encode(dtype, &data[from]))
    });
}

#[test]
fn every_collective_on_1_to_4_rank_threads() {
    if !common::plugin_or_skip("every_collective_on_1_to_4_rank_threads") {
        return;
    }
    for n in 1..=4 {
        for dtype in DType::ALL {
            // Every type at one element; the prime lengths on a spread of
            // types (each shape is a compiled program: this keeps the test
            // within seconds on two cores).
            let lens: &[usize] = if matches!(dtype, DType::F32 | DType::I64 | DType::BF16) {
                &LENS
            } else {
                &LENS[..1]
            };
            for &len in lens {
                reductions(n, dtype, len);
                data_movement(n, dtype, len);
            }
        }
    }
}

#[test]
fn avg_barrier_and_split() {
    if !common::plugin_or_skip("avg_barrier_and_split") {
        return;
    }
    let out = common::on_ranks(4, TIMEOUT, |r, c| {
        let mut f = vec![r as f32, 1.0, -(r as f32)];
        c.all_reduce_slice(&mut f, ReduceOp::Avg).unwrap();
        let mut i = vec![r as i32 * 3 + 1];
        c.all_reduce_slice(&mut i, ReduceOp::Avg).unwrap();
        c.barrier().unwrap();
        // Colors by parity, keys reversed: ranks {2, 0} and {3, 1}.
        let sub = c
            .split(Some((r % 2) as u32), (10 - r) as u32)
            .unwrap()
            .unwrap();
        let members = sub.all_gather_vec(&[r as i64]).unwrap();
        let mut s = vec![r as i64];
        sub.all_reduce_slice(&mut s, ReduceOp::Sum).unwrap();
        let none = c.split(None, 0).unwrap();
        (
            f,
            i,
            sub.rank(),
            sub.world_size(),
            members,
            s,
            none.is_none(),
        )
    });
    for (r, o) in out.into_iter().enumerate() {
        let (f, i, sub_rank, sub_world, members, s, none) = o.unwrap();
        assert_eq!(f, vec![1.5, 1.0, -1.5], "rank {r}");
        // (1 + 4 + 7 + 10) / 4 = 5.5, truncated toward zero.
        assert_eq!(i, vec![5], "rank {r}");
        assert_eq!(sub_world, 2);
        let want: Vec<i64> = if r % 2 == 0 { vec![2, 0] } else { vec![3, 1] };
        assert_eq!(members, want, "rank {r}");
        assert_eq!(sub_rank, usize::from(r < 2), "rank {r}");
        assert_eq!(s, vec![want.iter().sum::<i64>()]);
        assert!(none);
    }
}
