#!/usr/bin/env python3
"""Export a PyTorch module's layout as accel-layout/1 JSON.

The model is built on the meta device, so no weights are allocated and
even 100B-parameter models export in seconds. The JSON lists, for every
module in definition order, its class, its own parameters and buffers
(name, dtype, shape) and its children, plus the groups of tied parameters
(the same Parameter object reachable under several names). `accel plan
--layout FILE` plans it; see offload/src/layout.rs for the format.

Usage:
    # a Hugging Face model from its config (needs `transformers`)
    python tools/export_layout.py --config meta-llama/Meta-Llama-3-70B -o llama70b.json
    python tools/export_layout.py --config ./config.json --dtype bfloat16 -o model.json
    # any nn.Module: "package.module:factory" called with no arguments
    python tools/export_layout.py --factory mypkg.models:build_model -o model.json

Requires torch >= 2.0 (meta device); --config also needs transformers.
Tests (no torch needed): python3 -m unittest tools/test_export_layout.py
"""

import argparse
import importlib
import json
import sys

DTYPES = {
    "torch.float16": "f16",
    "torch.bfloat16": "bf16",
    "torch.float32": "f32",
    "torch.float64": "f64",
    "torch.int8": "i8",
    "torch.uint8": "u8",
    "torch.int32": "i32",
    "torch.int64": "i64",
}


def dtype_name(t):
    name = str(t.dtype)
    if name not in DTYPES:
        raise SystemExit(
            f"export_layout: dtype {name} is not carried by accel-offload "
            f"(supported: {', '.join(sorted(DTYPES))})"
        )
    return DTYPES[name]


def tensor_entry(name, t, persistent=True):
    entry = {"name": name, "dtype": dtype_name(t), "shape": list(t.shape)}
    if not persistent:
        entry["persistent"] = False
    return entry


def module_entry(name, module):
    """One module, recursively, in definition order.

    Parameters and buffers are the module's own (recurse=False); a
    parameter shared with another module appears under every name, and the
    sharing is recorded in the top-level "tied" list. Non-persistent
    buffers (rotary inv_freq, causal masks) are kept with
    "persistent": false: they are in no checkpoint, but they occupy device
    memory and Accelerate counts them in module sizes.
    """
    entry = {"name": name, "class": type(module).__name__}
    params = [
        tensor_entry(n, p)
        for n, p in module._parameters.items()
        if p is not None
    ]
    non_persistent = getattr(module, "_non_persistent_buffers_set", set())
    buffers = [
        tensor_entry(n, b, persistent=n not in non_persistent)
        for n, b in module._buffers.items()
        if b is not None
    ]
    children = [module_entry(n, c) for n, c in module._modules.items() if c is not None]
    if params:
        entry["params"] = params
    if buffers:
        entry["buffers"] = buffers
    if children:
        entry["children"] = children
    return entry


def tied_groups(model):
    """Names of parameters that are the same object, in definition order."""
    by_id = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def build_from_config(config_path, dtype, trust_remote_code):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModel

    config = AutoConfig.from_pretrained(config_path, trust_remote_code=trust_remote_code)
    kwargs = {"trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["torch_dtype"] = getattr(torch, dtype)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        except ValueError:
            model = AutoModel.from_config(config, **kwargs)
    # transformers ties weights in post_init(); make sure it has happened.
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def build_from_factory(spec, dtype):
    import torch

    module_name, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit("export_layout: --factory takes package.module:callable")
    factory = getattr(importlib.import_module(module_name), attr)
    with torch.device("meta"):
        model = factory()
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    return model


def layout_of(model):
    root = module_entry("", model)
    return {"format": "accel-layout/1", "root": root, "tied": tied_groups(model)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="Hugging Face model id or path to a config.json / model directory")
    src.add_argument("--factory", help="package.module:callable returning an nn.Module")
    ap.add_argument("--dtype", help="torch dtype to build with, e.g. bfloat16 (default: the config's / float32)")
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("-o", "--output", default="-", help="output file (default: stdout)")
    args = ap.parse_args(argv)

    if args.config:
        model = build_from_config(args.config, args.dtype, args.trust_remote_code)
    else:
        model = build_from_factory(args.factory, args.dtype)
    doc = layout_of(model)
    text = json.dumps(doc, separators=(",", ":"))
    if args.output == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        n = sum(1 for _ in model.named_parameters(remove_duplicate=False)) + sum(1 for _ in model.named_buffers())
        print(f"wrote {args.output}: {n} tensors, {len(doc['tied'])} tied groups", file=sys.stderr)


if __name__ == "__main__":
    main()
