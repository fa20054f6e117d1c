//! `accel bench-worker` (hidden): one rank of `accel bench` (or, under the
//! threads process model of `--backend xla`, one process of rank threads).
//! It connects like any accel program ([`accel::run`]), times the
//! collective at every size, and rank 0 appends one JSON line per size to
//! the result file the parent named.
//!
//! Timing, per size: `warmup` untimed calls, then `iters` times
//! { barrier; start; the collective; stop }. After the size, the per-rank
//! times are all-gathered; the time of an iteration is the largest over
//! ranks, and the row reports their median (and minimum). Buffers are
//! allocated once per size, zero-filled (no denormals, no overflow over
//! repeated sums), and reused across iterations.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use accel_api::{
    Buf, BufMut, Communicator, CommunicatorExt, DType, Error, HostBuf, HostBufMut, HostBytes,
    ReduceOp, Result, StartExt,
};

use super::workload::{median, BenchOp, Row, Workload};
use super::Line;

/// Arguments of `accel bench-worker`.
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    workload: Workload,

    /// Where rank 0 appends its JSON lines.
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
}

/// Eight-byte aligned zeroed memory viewed as `bytes` bytes (aligned for
/// every element type).
struct Aligned {
    words: Vec<i64>,
    bytes: usize,
}

impl Aligned {
    fn new(bytes: usize) -> Aligned {
        Aligned {
            words: vec![0; bytes.div_ceil(8)],
            bytes,
        }
    }

    fn view(&self, dtype: DType) -> Result<HostBuf<'_>> {
        let all = HostBuf::from(&self.words[..]).bytes();
        HostBuf::from_bytes(dtype, &all[..self.bytes])
    }

    fn view_mut(&mut self, dtype: DType) -> Result<HostBufMut<'_>> {
        let all = HostBufMut::from(&mut self.words[..]).into_bytes();
        HostBufMut::from_bytes(dtype, &mut all[..self.bytes])
    }
}

/// The buffers of one size: `a` is the in-place / send buffer, `b` the
/// receive buffer of out-of-place operations.
struct Buffers {
    a: Aligned,
    b: Aligned,
}

impl Buffers {
    fn new(op: BenchOp, world: usize, size: usize) -> Buffers {
        let chunk = size / world.max(1);
        let (a, b) = match op {
            BenchOp::AllReduce | BenchOp::Broadcast => (size, 0),
            BenchOp::AllGather => (chunk, size),
            BenchOp::ReduceScatter => (size, chunk),
            BenchOp::AllToAll => (size, size),
            BenchOp::Barrier => (0, 0),
        };
        Buffers {
            a: Aligned::new(a),
            b: Aligned::new(b),
        }
    }

    /// One call of `op`.
    fn step(&mut self, comm: &dyn Communicator, op: BenchOp, dtype: DType) -> Result<()> {
        match op {
            BenchOp::AllReduce => {
                comm.all_reduce(BufMut::Host(self.a.view_mut(dtype)?), ReduceOp::Sum)
            }
            BenchOp::Broadcast => comm.broadcast(BufMut::Host(self.a.view_mut(dtype)?), 0),
            BenchOp::AllGather => comm.all_gather(
                Buf::Host(self.a.view(dtype)?),
                BufMut::Host(self.b.view_mut(dtype)?),
            ),
            BenchOp::ReduceScatter => comm.reduce_scatter(
                Buf::Host(self.a.view(dtype)?),
                BufMut::Host(self.b.view_mut(dtype)?),
                ReduceOp::Sum,
            ),
            BenchOp::AllToAll => comm.all_to_all(
                Buf::Host(self.a.view(dtype)?),
                BufMut::Host(self.b.view_mut(dtype)?),
            ),
            BenchOp::Barrier => comm.barrier(),
        }
    }
}

/// `--async N`: per iteration, N blocking all-reduces, then N started
/// without waiting and waited for; the per-call times of both, in
/// microseconds (started, blocking).
fn time_outstanding(
    comm: &dyn Communicator,
    w: &Workload,
    size: usize,
    n: u32,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let count = size / w.dtype.size();
    let mut bufs: Vec<HostBytes> = (0..n).map(|_| HostBytes::zeroed(w.dtype, count)).collect();
    let round = |bufs: &mut Vec<HostBytes>, started: bool| -> Result<f64> {
        comm.barrier()?;
        let t0 = Instant::now();
        if started {
            let works = std::mem::take(bufs)
                .into_iter()
                .map(|b| comm.start_all_reduce(b, ReduceOp::Sum))
                .collect::<Result<Vec<_>>>()?;
            for work in works {
                bufs.push(work.wait()?);
            }
        } else {
            for b in bufs.iter_mut() {
                comm.all_reduce(BufMut::Host(b.host_mut()), ReduceOp::Sum)?;
            }
        }
        Ok(t0.elapsed().as_secs_f64() * 1e6 / f64::from(n))
    };
    for _ in 0..w.warmup {
        round(&mut bufs, false)?;
        round(&mut bufs, true)?;
    }
    let (mut started, mut blocking) = (Vec::new(), Vec::new());
    for _ in 0..w.iters {
        blocking.push(round(&mut bufs, false)?);
        started.push(round(&mut bufs, true)?);
    }
    Ok((started, blocking))
}

/// Time one size on this rank: the per-iteration times in microseconds.
fn time_size(comm: &dyn Communicator, w: &Workload, size: usize) -> Result<Vec<f64>> {
    let mut bufs = Buffers::new(w.op, comm.world_size(), size);
    for _ in 0..w.warmup {
        bufs.step(comm, w.op, w.dtype)?;
    }
    let mut times = Vec::with_capacity(w.iters as usize);
    for _ in 0..w.iters {
        comm.barrier()?;
        let t0 = Instant::now();
        bufs.step(comm, w.op, w.dtype)?;
        times.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    Ok(times)
}

/// The slowest rank's time of each iteration, from the all-gathered
/// rank-major times.
fn slowest(all: &[f64], iters: usize) -> Vec<f64> {
    let mut worst = vec![0.0f64; iters];
    for chunk in all.chunks(iters) {
        for (w, &t) in worst.iter_mut().zip(chunk) {
            *w = w.max(t);
        }
    }
    worst
}

pub fn run(args: WorkerArgs) -> Result<ExitCode> {
    // Either process model: one rank here, or (`accel bench --backend xla`)
    // this process's rank threads.
    accel::run(|acc| rank(acc, &args))?;
    Ok(ExitCode::SUCCESS)
}

/// One rank's part of the benchmark.
fn rank(acc: &accel::Accelerator, args: &WorkerArgs) -> Result<()> {
    let comm: &dyn Communicator = &**acc.comm();
    let (rank, world) = (comm.rank(), comm.world_size());
    let w = &args.workload;
    let mut out = if rank == 0 {
        let f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&args.out)
            .map_err(|e| Error::io(format!("cannot open {}", args.out.display()), e))?;
        Some(f)
    } else {
        None
    };
    let mut emit = |line: &Line| -> Result<()> {
        if let Some(f) = out.as_mut() {
            let mut s = serde_json::to_string(line).unwrap_or_default();
            s.push('\n');
            f.write_all(s.as_bytes())
                .and_then(|()| f.flush())
                .map_err(|e| Error::io(format!("cannot write {}", args.out.display()), e))?;
        }
        Ok(())
    };
    emit(&Line::Header {
        backend: acc.backend_name().to_string(),
        world_size: world,
    })?;
    for (size, count) in w.rows(world) {
        let (mine, blocking) = match w.outstanding {
            Some(n) => {
                let (started, blocking) = time_outstanding(comm, w, size as usize, n)?;
                (started, Some(blocking))
            }
            None => (time_size(comm, w, size as usize)?, None),
        };
        let all = comm.all_gather_vec(&mine)?;
        let worst = slowest(&all, mine.len());
        let mut row = Row::new(w.op, world, w.dtype, size, count, &worst);
        if let Some(b) = blocking {
            let all = comm.all_gather_vec(&b)?;
            row.blocking_us = Some(median(&slowest(&all, b.len())));
        }
        emit(&Line::Row(row))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slowest_takes_the_max_per_iteration() {
        let all = [1.0, 5.0, 3.0, /* rank 1 */ 2.0, 4.0, 3.5];
        assert_eq!(slowest(&all, 3), vec![2.0, 5.0, 3.5]);
        assert_eq!(slowest(&[1.0, 2.0], 2), vec![1.0, 2.0]);
    }

    #[test]
    fn buffers_have_the_shapes_each_op_needs() {
        let b = Buffers::new(BenchOp::AllGather, 4, 4096);
        assert_eq!((b.a.bytes, b.b.bytes), (1024, 4096));
        let b = Buffers::new(BenchOp::ReduceScatter, 4, 4096);
        assert_eq!((b.a.bytes, b.b.bytes), (4096, 1024));
        let mut b = Buffers::new(BenchOp::AllReduce, 2, 12);
        assert_eq!(b.a.view_mut(DType::F32).unwrap().len(), 3);
    }
}
