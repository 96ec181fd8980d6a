"""A non-editable install runs with the C kernels: build a wheel of the repository, install it into a
fresh directory, and in a separate interpreter (outside the repository, an empty kernel cache)
check that kvserve comes from that directory, that the kernels compile from the sources shipped
in the wheel into that cache (and a second build finds them there), and that a packed Q4_0 layer
runs them and matches the dequantized matmul. (The one compile from source in `make test`: a
kernel build takes ~40 s of a core.)

The venv's editable install is a plain `.pth` path entry, which `PYTHONPATH` precedes; the child
asserts where kvserve was imported from, so a finder that won anyway would fail the test.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.model.kernels.backend import KernelBackend

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

import kvserve
from kvserve.model.kernels import build
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.kernels.gguf_linear import GGUFQuantLinear

target, cache = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
assert Path(kvserve.__file__).resolve().is_relative_to(target), kvserve.__file__
assert build.source_dir().resolve().is_relative_to(target), build.source_dir()
assert sorted(p.name for p in build.source_dir().iterdir() if p.suffix in (".cpp", ".h")) == [
    "kvserve_attention.cpp", "kvserve_attention_avx512.cpp", "kvserve_avx512_helpers.h", "kvserve_forward.cpp",
    "kvserve_gemm_amx.cpp", "kvserve_gemm_avx512.cpp", "kvserve_kernels.cpp", "kvserve_kernels.h",
    "kvserve_repack_kquant.cpp", "kvserve_repack_q4.cpp", "kvserve_team.cpp", "kvserve_team.h"]
backend = KernelBackend.detect()
assert backend.lib is not None, backend.reason
built = list((cache / "kernels").glob("libkvserve_kernels-*.so"))
assert len(built) == 1, f"kernels not compiled into the fresh cache: {built}"
stamp = built[0].stat().st_mtime_ns
assert build.build(backend.features) == built[0] and built[0].stat().st_mtime_ns == stamp   # cached: no rebuild
w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
raw = quantize(w, Q.Q4_0)
layer = GGUFQuantLinear(raw, Q.Q4_0, 256, 64, backend=backend)
assert layer.desc is not None and layer.weight_f32 is None
x = torch.randn(3, 256)
ref = x.double() @ torch.from_numpy(dequantize(raw, Q.Q4_0)).double().T
err = float((layer(x).double() - ref).norm() / ref.norm())
assert err < 0.02, err
print("OK", backend.isa)
"""


def _copy_project(dst: Path) -> None:
    """The files a wheel is built from, so the build writes nothing into the shared checkout."""
    shutil.copy(REPO / "pyproject.toml", dst)
    shutil.copy(REPO / "README.md", dst)
    shutil.copytree(REPO / "src", dst / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))


@pytest.mark.skipif(KernelBackend.detect().lib is None, reason="no compiled kernels on this machine")
def test_wheel_install_runs_the_c_kernels(tmp_path):
    project, wheels, target, cache = (tmp_path / n for n in ("project", "wheels", "site", "cache"))
    project.mkdir()
    _copy_project(project)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(project)],
                   check=True, timeout=300, cwd=tmp_path)
    wheel = next(wheels.glob("kvserve-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=300, cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(target), "KVSERVE_CACHE_DIR": str(cache)}
    env.pop("KVSERVE_NO_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(target), str(cache)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("OK"), proc.stdout
