"""Compile the CPU kernels (kernels/cpu/*.cpp, shipped as package data) and load them via ctypes.

The library is compiled from source on this machine, once, into a cache directory keyed by the
source hash, compiler and flags: at `make setup` time (`python -m kvserve.model.kernels`) or on
first use. This module only builds and loads; which kernels a model runs is decided once, at load,
by the KernelBackend (backend.py), which is also where the reasons for running without them go.

Why ctypes and not a torch C++ op: a ctypes call with four arguments costs about a microsecond,
less than the torch dispatcher, and the build needs no torch headers (seconds, not a minute).
Threads: -fopenmp, loaded after torch so the kernels run on torch's own OpenMP team (see cpu/).
Why explicit -mavx2 -mfma -mf16c and not -march=native: the result is valid on every AVX2 host,
so a cache shared between machines, or a CPU that advertises more than it runs, cannot crash us.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

CXX_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared", "-pthread", "-std=c++17"]
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
KERNEL_VERSION = 13  # must match kvs_version() in the source


class KvsWeight(ctypes.Structure):
    """Mirror of `struct kvs_weight` in cpu/kvserve_kernels.h."""


KvsWeight._fields_ = [
    ("qtype", ctypes.c_int32),   # 5: segments (a fused projection whose members keep their types)
    ("rows", ctypes.c_int32),
    ("cols", ctypes.c_int32),
    ("isa", ctypes.c_int32),     # 0: AVX2 tiles, 1: AVX-512 VNNI, 2: AMX-INT8 (same results)
    ("sdtype", ctypes.c_int32),  # block scales: 0 float32, 1 float16, 2 Q4_K super-block bytes
    ("qs", ctypes.c_void_p),
    ("d", ctypes.c_void_p),
    ("m", ctypes.c_void_p),
    ("bias", ctypes.c_void_p),
    ("nseg", ctypes.c_int32),    # qtype 5: seg[0..nseg) cover the output rows in order
    ("seg", ctypes.POINTER(KvsWeight)),
]


def source_dir() -> Path:
    """The C++ sources, inside the installed package (kvserve/model/kernels/cpu/)."""
    return Path(__file__).resolve().parent / "cpu"


def cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve"
    )
    return Path(root) / "kernels"


def cpu_flags() -> set[str]:
    """The feature flags this CPU advertises (/proc/cpuinfo; empty where that is not readable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cxx_flags(features: set[str] | frozenset[str]) -> list[str]:
    """Baseline AVX2 flags, plus AVX-VNNI (one-instruction u8 x s8 dot) when `features` has it."""
    return CXX_FLAGS + (["-mavxvnni"] if "avx_vnni" in features else [])


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build(features: set[str] | frozenset[str], force: bool = False) -> Path:
    """Compile the library for a CPU with `features` if needed and return its path.
    Raises RuntimeError on failure."""
    src = source_dir()
    sources = sorted(src.glob("*.cpp"))
    if not sources:
        raise RuntimeError(f"kernel sources not found in {src}")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    flags = cxx_flags(features)
    digest = hashlib.sha256(cxx.encode() + " ".join(flags).encode())
    for path in sources + sorted(src.glob("*.h")):
        digest.update(path.name.encode() + path.read_bytes())
    out = cache_dir() / f"libkvserve_kernels-{digest.hexdigest()[:16]}.so"
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *flags, "-o", tmp, *map(str, sources)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"kernel build failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    os.replace(tmp, out)  # atomic: concurrent builders race harmlessly
    return out


# One loaded library per built file: a process that loads several models (or several backends in
# tests) dlopens each build once. Only the library lives here; every choice lives in a backend.
_loaded: dict[Path, ctypes.CDLL] = {}
_lock = threading.Lock()


def load(features: set[str] | frozenset[str]) -> ctypes.CDLL:
    """Build (if needed) and load the library for `features`. Raises RuntimeError on failure."""
    path = build(features)
    with _lock:
        lib = _loaded.get(path)
        if lib is None:
            import torch  # first: our libgomp.so.1 must resolve to torch's, so both share one thread team

            lib = ctypes.CDLL(str(path))
            if lib.kvs_version() != KERNEL_VERSION:
                raise RuntimeError("kernel library version mismatch; rebuild with `make setup`")
            _declare(lib)
            lib.kvs_set_num_threads(max(1, torch.get_num_threads()))
            _loaded[path] = lib
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    lib.kvs_repack.argtypes = [i32, vp, i32, i32, vp, vp, vp, i32]
    lib.kvs_repack.restype = i32
    lib.kvs_repack_q4.argtypes = [i32, vp, i32, i32, vp, vp, vp, i32]
    lib.kvs_repack_q4.restype = i32
    lib.kvs_pack_q4.argtypes = [i32, i32, vp, vp, vp, vp, vp, vp]
    lib.kvs_pack_q4.restype = None
    lib.kvs_repack_q4_k.argtypes = [vp, i32, i32, vp, vp, vp]
    lib.kvs_repack_q4_k.restype = None
    lib.kvs_repack_q4_k_super.argtypes = [vp, i32, i32, vp, vp]
    lib.kvs_repack_q4_k_super.restype = None
    lib.kvs_repack_q5_k_super.argtypes = [vp, i32, i32, vp, vp]
    lib.kvs_repack_q5_k_super.restype = None
    lib.kvs_repack_q6_k.argtypes = [vp, i32, i32, vp, vp]
    lib.kvs_repack_q6_k.restype = None
    lib.kvs_packed_kscale_bytes.argtypes = [i32, i32, i32]
    lib.kvs_packed_kscale_bytes.restype = ctypes.c_size_t
    lib.kvs_repack_q8_0.argtypes = [vp, i32, i32, vp, vp, i32]
    lib.kvs_repack_q8_0.restype = None
    lib.kvs_q8_0_rows.argtypes = [i32, vp, i32, i32, vp]
    lib.kvs_q8_0_rows.restype = i32
    lib.kvs_packed_qs_bytes.argtypes = [i32, i32, i32]
    lib.kvs_packed_qs_bytes.restype = ctypes.c_size_t
    lib.kvs_packed_scales.argtypes = [i32, i32]
    lib.kvs_packed_scales.restype = ctypes.c_size_t
    lib.kvs_linear.argtypes = [vp, vp, i32, vp]
    lib.kvs_linear.restype = None
    lib.kvs_paged_attention.argtypes = [vp, vp, i32, i32, i32, i32, i32, i32, vp, i32, vp, vp, i32,
                                        ctypes.c_float, vp, i32]
    lib.kvs_paged_attention.restype = None
    lib.kvs_set_dynamic_rows.argtypes = [i32]
    lib.kvs_set_dynamic_rows.restype = None
    lib.kvs_team_shed_at.argtypes = [i32]
    lib.kvs_team_shed_at.restype = None
    lib.kvs_forward.argtypes = [vp, i32, i32, i32, vp, i32, vp, vp, vp, vp, i32, vp, i32]
    lib.kvs_forward.restype = i32
    lib.kvs_forward_lora.argtypes = [vp, i32, i32, i32, vp, i32, vp, vp, vp, vp, i32, vp, i32, vp, i32, vp, vp, i32]
    lib.kvs_forward_lora.restype = i32
    lib.kvs_draft_step.argtypes = [vp, i32, i32, i32, vp, i32, vp, vp, vp, vp, i32, vp, vp, vp, vp, i32, vp, i32, vp,
                                   vp, vp, vp, vp, i32]
    lib.kvs_draft_step.restype = i32
    lib.kvs_rope_kv_attention.argtypes = [vp, i32, vp, i32, vp, vp, vp, vp, i32, vp, i32, i32, i32, vp, vp, i32]
    lib.kvs_rope_kv_attention.restype = None
    lib.kvs_silu_mul.argtypes = [vp, i32, i32, vp, i32]
    lib.kvs_silu_mul.restype = None
    lib.kvs_gelu_mul.argtypes = [vp, i32, i32, vp, i32]
    lib.kvs_gelu_mul.restype = None
    lib.kvs_rms_norm.argtypes = [vp, vp, i32, i32, ctypes.c_float, vp]
    lib.kvs_rms_norm.restype = None
    lib.kvs_dequantize.argtypes = [vp, vp]
    lib.kvs_dequantize.restype = None
    lib.kvs_dequantize_rows.argtypes = [vp, vp, i32, vp]
    lib.kvs_dequantize_rows.restype = i32
    lib.kvs_amx_init.argtypes = []
    lib.kvs_amx_init.restype = i32
    lib.kvs_set_num_threads.argtypes = [i32]
    lib.kvs_set_num_threads.restype = None
    lib.kvs_get_num_threads.restype = i32


def main() -> int:
    """`python -m kvserve.model.kernels`: build at setup time; never fails setup."""
    features = cpu_flags()
    try:
        if not all(f in features for f in REQUIRED_CPU_FLAGS):
            print(f"kvserve kernels: skipped, CPU lacks one of {REQUIRED_CPU_FLAGS}", file=sys.stderr)
            return 0
        print(f"kvserve kernels: {build(features)}")
    except RuntimeError as e:
        print(f"kvserve kernels: not built ({e}); the PyTorch fallback will be used", file=sys.stderr)
    return 0


def any_loaded() -> ctypes.CDLL | None:
    """A kernel library this process has already loaded (for its load-time repack functions,
    which every build has), or None."""
    with _lock:
        return next(iter(_loaded.values()), None)

