#!/usr/bin/env python3
"""Tests for export_layout.py that need no torch: stand-in modules with the
attributes export_layout reads (_parameters, _buffers, _modules,
_non_persistent_buffers_set) and tensors with dtype and shape.

    python3 -m unittest tools/test_export_layout.py
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_layout  # noqa: E402


class T:
    def __init__(self, dtype, shape):
        self.dtype = dtype
        self.shape = shape


class Rotary:
    def __init__(self):
        self._parameters = {}
        self._buffers = {"inv_freq": T("torch.float32", (32,)), "scale": T("torch.float32", ())}
        self._non_persistent_buffers_set = {"inv_freq"}
        self._modules = {}


class Net:
    def __init__(self):
        self._parameters = {"w": T("torch.bfloat16", (4, 4))}
        self._buffers = {}
        self._non_persistent_buffers_set = set()
        self._modules = {"rotary_emb": Rotary()}


class ExportLayoutTest(unittest.TestCase):
    def test_non_persistent_buffers_are_kept_and_marked(self):
        entry = export_layout.module_entry("", Net())
        rotary = entry["children"][0]
        self.assertEqual(rotary["class"], "Rotary")
        by_name = {b["name"]: b for b in rotary["buffers"]}
        self.assertEqual(set(by_name), {"inv_freq", "scale"})
        self.assertIs(by_name["inv_freq"]["persistent"], False)
        self.assertNotIn("persistent", by_name["scale"])
        self.assertEqual(by_name["inv_freq"]["shape"], [32])
        self.assertEqual(entry["params"][0]["dtype"], "bf16")


if __name__ == "__main__":
    unittest.main()
