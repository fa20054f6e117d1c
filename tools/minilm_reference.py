#!/usr/bin/env python3
"""Reference cosine similarities for the tch MiniLM example, outside Rust and libtorch.

sentence-transformers itself needs PyTorch, which this project's machines cannot
install from PyPI without the multi-GB CUDA wheels; this script is the same
pipeline in NumPy, written from transformers' BertModel (eager attention) and
sentence-transformers' Pooling(mean) + Normalize, with Hugging Face's Python
`tokenizers` on the model's own tokenizer.json. It reproduces the two values
sentence-transformers gives (0.7553 and 0.8939, quoted in issue 20), which
checks it; the other pairs in docs/inference.md come from it.

Usage (a venv with tokenizers, numpy, safetensors: `make venv-tb` makes .venv-tb):
    python tools/minilm_reference.py [--embeddings] [MODEL_DIR]   # default .accel-cache/minilm/model
Prints one JSON object: sentences and their similarity matrix (with
--embeddings also the unit-length sentence embeddings, float64, which the
tch and candle MiniLM examples' tests compare theirs with).
"""
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer


def example_sentences():
    """The examples' sentences, read from SENTENCES in
    examples/minilm-data/src/lib.rs: one list for the Rust examples and this
    reference (their tests compare embeddings sentence by sentence)."""
    src = (Path(__file__).resolve().parent.parent
           / "examples/minilm-data/src/lib.rs").read_text()
    block = src.split("pub const SENTENCES")[1].split("];")[0].split("= [", 1)[1]
    return [json.loads(f'"{s}"') for s in re.findall(r'"((?:[^"\\]|\\.)*)"', block)]


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu(x):
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def embed(model_dir, sentences):
    cfg = json.loads((model_dir / "config.json").read_text())
    w = {k: v.astype(np.float64) if v.dtype != np.int64 else v
         for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(256)
    eps = cfg["layer_norm_eps"]
    heads = cfg["num_attention_heads"]
    out = []
    for s in sentences:  # one at a time: no padding to mask
        enc = tok.encode(s)
        ids = np.array(enc.ids)
        tt = np.array(enc.type_ids)
        t = len(ids)
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.token_type_embeddings.weight"][tt]
             + w["embeddings.position_embeddings.weight"][np.arange(t)])
        x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        for i in range(cfg["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            lin = lambda y, n: y @ w[p + n + ".weight"].T + w[p + n + ".bias"]
            d = x.shape[-1] // heads
            split = lambda y: y.reshape(t, heads, d).transpose(1, 0, 2)
            q, k, v = (split(lin(x, "attention.self." + n)) for n in ("query", "key", "value"))
            sc = q @ k.transpose(0, 2, 1) / math.sqrt(d)
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            sc /= sc.sum(-1, keepdims=True)
            ctx = (sc @ v).transpose(1, 0, 2).reshape(t, -1)
            a = layer_norm(lin(ctx, "attention.output.dense") + x,
                           w[p + "attention.output.LayerNorm.weight"],
                           w[p + "attention.output.LayerNorm.bias"], eps)
            f = gelu(lin(a, "intermediate.dense"))
            x = layer_norm(lin(f, "output.dense") + a,
                           w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
        m = x.mean(0)
        out.append(m / max(np.linalg.norm(m), 1e-12))
    return np.stack(out)


def main():
    args = [a for a in sys.argv[1:] if a != "--embeddings"]
    model_dir = Path(args[0]) if args else (
        Path(__file__).resolve().parent.parent / ".accel-cache/minilm/model")
    sentences = example_sentences()
    e = embed(model_dir, sentences)
    out = {"sentences": sentences, "similarities": (e @ e.T).round(4).tolist()}
    if "--embeddings" in sys.argv[1:]:
        out["embeddings"] = e.tolist()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
