"""The digits demo in PyTorch with Accelerate + DDP: the same MLP, data
split, batch, accumulation and optimizer as examples/tch-digits and
examples/candle-digits, timed the same way (ms per optimizer step over the
whole run), for scripts/bench_digits.sh.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 \
        tools/digits_ddp.py --data .accel-cache/tch/data/digits.csv.gz --epochs 20

(Without ACCELERATE_USE_CPU on a machine without GPUs, Accelerate 1.15
starts two independent one-process runs instead of one DDP run of two.)
Prints, on the main process: `final: N steps, loss L, X ms/step, P processes`.
"""
import argparse
import gzip
import time

import torch
from accelerate import Accelerator
from torch import nn


def load(path):
    rows = []
    with gzip.open(path, "rt") as f:
        for line in f:
            if line.strip():
                rows.append([float(v) for v in line.split(",")])
    data = torch.tensor(rows, dtype=torch.float32)
    x, y = data[:, :64], data[:, 64].long()
    # Every fifth image is held out, as the Rust demos split it.
    keep = torch.tensor([i % 5 != 4 for i in range(len(rows))])
    return x[keep], y[keep]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--train-len", type=int, default=None, help="use only the first N training images")
    a = p.parse_args()
    torch.set_num_threads(1)
    acc = Accelerator(gradient_accumulation_steps=a.accumulation)
    torch.manual_seed(a.seed)
    x, y = load(a.data)
    if a.train_len is not None:
        x, y = x[: a.train_len], y[: a.train_len]
    ds = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(ds, batch_size=a.batch_size, shuffle=True)
    h = a.hidden
    model = nn.Sequential(nn.Linear(64, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    model, opt, loader = acc.prepare(model, opt, loader)
    lossf = nn.CrossEntropyLoss()
    steps, elapsed, last = 0, 0.0, float("nan")
    t = time.perf_counter()
    for _ in range(a.epochs):
        for xb, yb in loader:
            with acc.accumulate(model):
                loss = lossf(model(xb), yb)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            if acc.sync_gradients:
                last = acc.reduce(loss.detach(), reduction="mean").item()
                steps += 1
                now = time.perf_counter()
                elapsed += now - t
                t = now
    if acc.is_main_process:
        ms = 1e3 * elapsed / max(steps, 1)
        print(f"final: {steps} steps, loss {last:.4f}, {ms:.2f} ms/step, {acc.num_processes} processes", flush=True)
    acc.wait_for_everyone()
    acc.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
