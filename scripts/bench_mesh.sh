#!/usr/bin/env bash
# The device mesh's cost (issue 39): a decoder-style language model (vocab
# 4096, width 256, feed-forward 1024, 4 blocks, 16 x 64 tokens a step)
# trained on 4 rank threads over cpu-gloo at dp_shard=2 x tp=2 (vocab-
# parallel embedding and cross entropy, column- and row-parallel blocks and
# head) and at dp_shard=4 (the same code, the tp group of one rank),
# interleaved rounds; per round the median step time (the slowest rank's),
# then medians, bests, their ratio and each configuration's parameters per
# rank. The model is integrations/candle/tests/decoder_mesh.rs's, whose
# test proves the mesh run equal to one rank.
#
#   scripts/bench_mesh.sh [ROUNDS (3)]
set -euo pipefail
cd "$(dirname "$0")/.."
ACCEL_BENCH_ROUNDS=${1:-3} exec cargo test --release -q -p accel-candle --test decoder_mesh \
  -- --ignored --nocapture --test-threads 1 bench_mesh_step_time
