//! What a benchmark measures: the operation, the sizes, the element type,
//! the iteration counts (the flags shared by `accel bench` and its hidden
//! worker), and the arithmetic of nccl-tests' table: element counts per
//! buffer, algorithm and bus bandwidth.

use std::fmt;
use std::str::FromStr;

use accel_api::{DType, Error, ErrorKind, Result};

/// A collective that `accel bench` can time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum BenchOp {
    /// In-place sum all-reduce.
    #[value(alias = "all-reduce", alias = "allreduce")]
    AllReduce,
    /// All-gather; the size is the gathered (receive) buffer.
    #[value(alias = "all-gather", alias = "allgather")]
    AllGather,
    /// Broadcast from rank 0.
    Broadcast,
    /// Sum reduce-scatter; the size is the (send) buffer before scattering.
    #[value(alias = "reduce-scatter", alias = "reducescatter")]
    ReduceScatter,
    /// All-to-all; the size is the send (= receive) buffer.
    #[value(alias = "all-to-all", alias = "alltoall")]
    AllToAll,
    /// Barrier (one row, no payload).
    Barrier,
}

impl BenchOp {
    /// The spelling on the command line and in the output.
    pub fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all_reduce",
            BenchOp::AllGather => "all_gather",
            BenchOp::Broadcast => "broadcast",
            BenchOp::ReduceScatter => "reduce_scatter",
            BenchOp::AllToAll => "all_to_all",
            BenchOp::Barrier => "barrier",
        }
    }

    /// nccl-tests' bus bandwidth factor for `n` ranks (busbw = algbw ×
    /// factor): what each link carries relative to the buffer, so that
    /// busbw is comparable to the link bandwidth at any rank count.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::AllGather | BenchOp::ReduceScatter | BenchOp::AllToAll => (n - 1.0) / n,
            BenchOp::Broadcast => 1.0,
            BenchOp::Barrier => 0.0,
        }
    }

    /// Whether the buffer is split into one chunk per rank (its element
    /// count must then be a multiple of the rank count).
    pub fn chunked(self) -> bool {
        matches!(
            self,
            BenchOp::AllGather | BenchOp::ReduceScatter | BenchOp::AllToAll
        )
    }
}

impl fmt::Display for BenchOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `MIN:MAX` (or one size) in bytes, with binary suffixes `K`, `M`, `G`
/// (`4K:256M`); the benchmark doubles from `MIN` while the size is at most
/// `MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeRange {
    /// First size, bytes.
    pub min: u64,
    /// Last size allowed, bytes.
    pub max: u64,
}

/// Parse `4096`, `4K`, `4KiB`, `1M`, `2G` (binary multiples), `B` allowed.
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let bad = || {
        Error::new(
            ErrorKind::InvalidArgument,
            format!("`{s}` is not a size (examples: 4096, 4K, 1M, 256M, 1G)"),
        )
    };
    let n: u64 = num.parse().map_err(|_| bad())?;
    let mul: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(bad()),
    };
    n.checked_mul(mul).ok_or_else(bad)
}

impl FromStr for SizeRange {
    type Err = Error;

    fn from_str(s: &str) -> Result<SizeRange> {
        let (a, b) = s.split_once(':').unwrap_or((s, s));
        let (min, max) = (parse_bytes(a)?, parse_bytes(b)?);
        if min == 0 || min > max {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("sizes `{s}`: need 0 < MIN <= MAX"),
            ));
        }
        Ok(SizeRange { min, max })
    }
}

impl fmt::Display for SizeRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.min, self.max)
    }
}

impl SizeRange {
    /// The sizes, doubling from `min` while at most `max`.
    pub fn sizes(&self) -> Vec<u64> {
        let mut v = Vec::new();
        let mut s = self.min;
        while s <= self.max {
            v.push(s);
            match s.checked_mul(2) {
                Some(n) => s = n,
                None => break,
            }
        }
        v
    }
}

fn parse_range(s: &str) -> std::result::Result<SizeRange, String> {
    s.parse().map_err(|e: Error| e.message().to_string())
}

fn parse_dtype(s: &str) -> std::result::Result<DType, String> {
    s.parse().map_err(|e: Error| e.message().to_string())
}

/// The flags shared by `accel bench` and `accel bench-worker`.
#[derive(Debug, Clone, clap::Args)]
pub struct Workload {
    /// The collective to time.
    #[arg(long, value_enum, default_value = "all_reduce")]
    pub op: BenchOp,

    /// Buffer sizes in bytes, MIN:MAX doubling (binary K/M/G suffixes), or
    /// one size.
    #[arg(long, default_value = "4K:64M", value_parser = parse_range, value_name = "MIN:MAX")]
    pub sizes: SizeRange,

    /// Element type.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: DType,

    /// Timed iterations per size (the reported time is their median).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: u32,

    /// Untimed iterations per size before the timed ones.
    #[arg(long, default_value_t = 5)]
    pub warmup: u32,

    /// Time N all-reduces started without waiting (in flight together,
    /// then waited for) against N blocking ones, interleaved in each
    /// iteration; both columns are per call.
    #[arg(long = "async", value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub outstanding: Option<u32>,
}

impl Workload {
    /// The flags that rebuild this workload (for the worker's command line).
    pub fn to_args(&self) -> Vec<String> {
        vec![
            "--op".into(),
            self.op.name().into(),
            "--sizes".into(),
            self.sizes.to_string(),
            "--dtype".into(),
            self.dtype.name().into(),
            "--iters".into(),
            self.iters.to_string(),
            "--warmup".into(),
            self.warmup.to_string(),
        ]
        .into_iter()
        .chain(
            self.outstanding
                .into_iter()
                .flat_map(|n| ["--async".to_string(), n.to_string()]),
        )
        .collect()
    }

    /// The `(bytes, elements)` of every row for `world` ranks: sizes are
    /// rounded down to whole elements (and, for chunked operations, to a
    /// multiple of `world` elements, as nccl-tests does); sizes that round
    /// to nothing and repeats are dropped. A barrier has one row of 0.
    pub fn rows(&self, world: usize) -> Vec<(u64, u64)> {
        if self.op == BenchOp::Barrier {
            return vec![(0, 0)];
        }
        let elem = self.dtype.size() as u64;
        let unit = if self.op.chunked() {
            world.max(1) as u64
        } else {
            1
        };
        let mut out: Vec<(u64, u64)> = Vec::new();
        for s in self.sizes.sizes() {
            let count = s / elem / unit * unit;
            if count == 0 || out.last().is_some_and(|&(_, c)| c == count) {
                continue;
            }
            out.push((count * elem, count));
        }
        out
    }
}

/// One line of the result table.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Row {
    /// Buffer size in bytes (see [`BenchOp`] for which buffer).
    pub size: u64,
    /// Elements in that buffer.
    pub count: u64,
    /// Element type.
    pub dtype: String,
    /// Median over iterations of the slowest rank's time, microseconds.
    pub time_us: f64,
    /// Fastest iteration (slowest rank), microseconds.
    pub min_us: f64,
    /// size / time, GB/s (10^9 bytes per second).
    pub algbw_gbs: f64,
    /// algbw × the operation's bus factor, GB/s.
    pub busbw_gbs: f64,
    /// With `--async N`: the median time per call of N blocking calls
    /// (`time_us` is then per call of N started ones), microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocking_us: Option<f64>,
}

/// The median of `v` (the mean of the middle two for an even count); 0 for
/// an empty slice.
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => s[n / 2],
        _ => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

impl Row {
    /// The row of one size from the per-iteration times (already the
    /// slowest rank's, in microseconds).
    pub fn new(
        op: BenchOp,
        world: usize,
        dtype: DType,
        size: u64,
        count: u64,
        times: &[f64],
    ) -> Row {
        let time_us = median(times);
        let min_us = times.iter().copied().fold(f64::INFINITY, f64::min);
        let algbw_gbs = if time_us > 0.0 {
            size as f64 / (time_us * 1e3)
        } else {
            0.0
        };
        Row {
            size,
            count,
            dtype: dtype.name().to_string(),
            time_us,
            min_us: if min_us.is_finite() { min_us } else { 0.0 },
            algbw_gbs,
            busbw_gbs: algbw_gbs * op.bus_factor(world),
            blocking_us: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("4K").unwrap(), 4096);
        assert_eq!(parse_bytes("4KiB").unwrap(), 4096);
        assert_eq!(parse_bytes("256M").unwrap(), 256 << 20);
        assert_eq!(parse_bytes("1g").unwrap(), 1 << 30);
        assert!(parse_bytes("4X").is_err());
        assert!(parse_bytes("").is_err());
        let r: SizeRange = "4K:64K".parse().unwrap();
        assert_eq!(r.sizes(), vec![4096, 8192, 16384, 32768, 65536]);
        let one: SizeRange = "1M".parse().unwrap();
        assert_eq!(one.sizes(), vec![1 << 20]);
        assert!("64K:4K".parse::<SizeRange>().is_err());
        assert!("0:4K".parse::<SizeRange>().is_err());
    }

    #[test]
    fn bus_factors_are_nccl_tests() {
        assert_eq!(BenchOp::AllReduce.bus_factor(2), 1.0);
        assert_eq!(BenchOp::AllReduce.bus_factor(4), 1.5);
        assert_eq!(BenchOp::AllGather.bus_factor(4), 0.75);
        assert_eq!(BenchOp::ReduceScatter.bus_factor(2), 0.5);
        assert_eq!(BenchOp::AllToAll.bus_factor(8), 0.875);
        assert_eq!(BenchOp::Broadcast.bus_factor(8), 1.0);
        assert_eq!(BenchOp::AllReduce.bus_factor(1), 0.0);
    }

    fn workload(op: BenchOp, sizes: &str, dtype: DType) -> Workload {
        Workload {
            op,
            sizes: sizes.parse().unwrap(),
            dtype,
            iters: 1,
            warmup: 0,
            outstanding: None,
        }
    }

    #[test]
    fn async_rides_on_the_workers_flags() {
        let mut w = workload(BenchOp::AllReduce, "4K", DType::F32);
        assert!(!w.to_args().contains(&"--async".to_string()));
        w.outstanding = Some(4);
        let args = w.to_args();
        let at = args
            .iter()
            .position(|a| a == "--async")
            .expect("--async passed on");
        assert_eq!(args[at + 1], "4");
    }

    #[test]
    fn rows_round_to_elements_and_chunks() {
        let w = workload(BenchOp::AllReduce, "4:32", DType::F64);
        assert_eq!(w.rows(2), vec![(8, 1), (16, 2), (32, 4)]);
        let w = workload(BenchOp::AllGather, "4K:8K", DType::F32);
        assert_eq!(w.rows(3), vec![(4092, 1023), (8184, 2046)]);
        let w = workload(BenchOp::Barrier, "4K:8K", DType::F32);
        assert_eq!(w.rows(3), vec![(0, 0)]);
        // Sizes below one chunk per rank vanish; repeats collapse.
        let w = workload(BenchOp::AllToAll, "1:16", DType::F32);
        assert_eq!(w.rows(2), vec![(8, 2), (16, 4)]);
    }

    #[test]
    fn row_arithmetic() {
        let r = Row::new(
            BenchOp::AllReduce,
            4,
            DType::F32,
            1_000_000,
            250_000,
            &[3.0, 1.0, 2.0],
        );
        assert_eq!(r.time_us, 2.0);
        assert_eq!(r.min_us, 1.0);
        assert!((r.algbw_gbs - 500.0).abs() < 1e-9);
        assert!((r.busbw_gbs - 750.0).abs() < 1e-9);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn workload_round_trips_through_its_flags() {
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            w: Workload,
        }
        let w = workload(BenchOp::ReduceScatter, "4K:1M", DType::I32);
        let mut argv = vec!["x".to_string()];
        argv.extend(w.to_args());
        let p = <P as clap::Parser>::try_parse_from(argv).unwrap();
        assert_eq!(p.w.op, w.op);
        assert_eq!(p.w.sizes, w.sizes);
        assert_eq!(p.w.dtype, w.dtype);
    }
}
