#!/usr/bin/env python3
"""Empty stand-ins for the CUDA libraries that torch's PyPI wheel links but a
CPU-only `import torch` never calls (cuDNN, cuBLAS, NCCL, ...: about 3 GB of
wheels). Each stand-in has the library's soname and defines every symbol
torch's libraries take from it (with its symbol version), as a function that
returns an error code; none is ever called on a machine without a GPU, where
torch.cuda.is_available() is False. This is test tooling for the torch venv
of `make torch-venv` only: accel's own CUDA backend never loads these.

Usage: torch_cpu_stubs.py SITE_PACKAGES   (writes into SITE_PACKAGES/torch/lib)
"""
import glob
import os
import re
import subprocess
import sys
import tempfile

SYSTEM = re.compile(r"^(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|ld-linux|libgomp|libutil)[.-]")
# Unversioned symbols of the libraries stubbed (CUDA driver, cuFile, NCCL,
# cuSPARSELt, NVSHMEM): defined in every stand-in, harmless duplicates.
UNVERSIONED = ("cu", "nccl", "nvshmem")


def syms(path, und):
    out = subprocess.run(["readelf", "-W", "--dyn-syms", path], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        p = line.split()
        if len(p) >= 8 and (p[6] == "UND") == und and p[4] != "WEAK":
            yield p[7], p[3]


def main(sp):
    lib = os.path.join(sp, "torch", "lib")
    libs = glob.glob(f"{lib}/*.so*") + glob.glob(f"{sp}/torch/*.so")
    present = {os.path.basename(p) for p in libs + glob.glob(f"{sp}/nvidia/*/lib/*.so*")}
    needed, versioned, unversioned = set(), {}, set()
    for f in libs:
        d = subprocess.run(["readelf", "-dW", f], capture_output=True, text=True, check=True).stdout
        needed |= set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", d))
        for name, typ in syms(f, True):
            if "@" in name:
                sym, ver = name.split("@", 1)
                versioned.setdefault(ver.lstrip("@").split()[0], set()).add((sym, typ))
            elif name.startswith(UNVERSIONED):
                unversioned.add((name, typ))
    missing = sorted(n for n in needed if n not in present and not SYSTEM.match(n))
    with tempfile.TemporaryDirectory() as tmp:
        for so in missing:
            mine = {ver: s for ver, s in versioned.items() if ver == so or (ver == "NVSHMEM" and "nvshmem" in so)}
            body, script = [], []
            done = set()
            for ver, ss in mine.items():
                script.append(f"{ver} {{ global: {'; '.join(sorted(n for n, _ in ss))}; }};")
                for n, t in ss:
                    done.add(n)
                    body.append(f"int {n};" if t == "OBJECT" else f"int {n}(void) {{ return 999; }}")
            for n, t in unversioned:
                if n not in done:
                    body.append(f"int {n};" if t == "OBJECT" else f"int {n}(void) {{ return 999; }}")
            src = os.path.join(tmp, so + ".c")
            with open(src, "w") as fh:
                fh.write("\n".join(sorted(set(body))) + "\n")
            cmd = ["gcc", "-shared", "-fPIC", "-w", "-o", os.path.join(lib, so), src, f"-Wl,-soname,{so}"]
            if script:
                vs = os.path.join(tmp, so + ".map")
                with open(vs, "w") as fh:
                    fh.write("\n".join(script) + "\n")
                cmd.append(f"-Wl,--version-script={vs}")
            subprocess.run(cmd, check=True)
    print("torch-venv: stand-ins for", " ".join(missing) or "nothing")


if __name__ == "__main__":
    main(sys.argv[1])
