"""torch.distributed's gloo all-reduce, timed the way `accel bench` and
benches/raw_gloo/raw_gloo_bench.cc time it (the third column of
scripts/bench_gloo.sh).

One process per rank, all with the same init file:

    python3 torch_gloo_bench.py --rank R --size N --init-file PATH \
        [--min 4K] [--max 64M] [--iters 20] [--warmup 5]

Per size (doubling, float32, sum): `warmup` untimed all-reduces, then
`iters` times { barrier; t0; all_reduce; t1 }; the per-rank times are
all-gathered, an iteration's time is the slowest rank's, and rank 0 prints
`size_bytes count median_us min_us`.
"""
import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def parse_size(s):
    units = {"": 1, "B": 1, "K": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MIB": 1 << 20,
             "G": 1 << 30, "GIB": 1 << 30}
    digits = len(s) - len(s.lstrip("0123456789"))
    return int(s[:digits]) * units[s[digits:].upper()]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--init-file", required=True)
    p.add_argument("--min", default="4K")
    p.add_argument("--max", default="64M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    dist.init_process_group("gloo", init_method=f"file://{a.init_file}", rank=a.rank,
                            world_size=a.size, timeout=timedelta(minutes=5))
    torch.set_num_threads(1)
    nbytes, hi = parse_size(a.min), parse_size(a.max)
    while nbytes <= hi:
        count = nbytes // 4
        buf = torch.zeros(count, dtype=torch.float32)
        for _ in range(a.warmup):
            dist.all_reduce(buf)
        mine = []
        for _ in range(a.iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            mine.append((time.perf_counter() - t0) * 1e6)
        out = [torch.zeros(a.iters, dtype=torch.float64) for _ in range(a.size)]
        dist.all_gather(out, torch.tensor(mine, dtype=torch.float64))
        if a.rank == 0:
            worst = torch.stack(out).max(dim=0).values.tolist()
            print(f"{nbytes} {count} {statistics.median(worst):.2f} {min(worst):.2f}", flush=True)
        nbytes *= 2
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
