#!/usr/bin/env python3
"""Launch to first barrier of a 2-rank torch program: `accel launch` against
torchrun and `accelerate launch`, interleaved, ROUNDS rounds (default 5),
medians and bests, plus `import torch.distributed` alone (what every launch
pays per rank). Needs `make torch-venv` and an `accel` build (ACCEL=path;
default target/release/accel, else target/debug/accel).

    scripts/bench_torch_launch.py [ROUNDS]
"""
import os, statistics, subprocess, sys, tempfile, time

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
bin_dir = os.path.join(root, ".accel-cache", "torch-venv", "bin")
accel = os.environ.get("ACCEL") or next(
    p for p in (os.path.join(root, "target", t, "accel") for t in ("release", "debug")) if os.path.exists(p))
env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"])
env.pop("OMP_NUM_THREADS", None)
tmp = tempfile.mkdtemp()
prog = os.path.join(tmp, "barrier.py")
with open(prog, "w") as f:
    f.write("import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.barrier()\ndist.destroy_process_group()\n")
cmds = {
    "accel launch": [accel, "launch", "-n", "2", prog],
    "torchrun": ["torchrun", "--standalone", "--nproc-per-node", "2", prog],
    "accelerate": ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", prog],
    "import only": ["python3", "-c", "import torch.distributed"],
}
times = {k: [] for k in cmds}
for _ in range(rounds):
    for k, c in cmds.items():
        t = time.perf_counter()
        subprocess.run(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times[k].append(time.perf_counter() - t)
print(f"load average {os.getloadavg()[0]:.2f}; {rounds} rounds, interleaved; accel: {accel}")
print(f"{'launcher':14} {'median s':>9} {'best s':>8}")
for k, v in times.items():
    print(f"{k:14} {statistics.median(v):9.3f} {min(v):8.3f}")
a = times["accel launch"]
for k in ("torchrun", "accelerate"):
    print(f"{k} / accel launch: median {statistics.median(times[k]) / statistics.median(a):.2f}x, best {min(times[k]) / min(a):.2f}x")
