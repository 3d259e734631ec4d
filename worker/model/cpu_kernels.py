"""Our C++ CPU kernels, compiled on first use with torch's extension builder.

Only where they measurably pay (see docs/benchmarks.md): decode attention reading K/V
through block tables in place. If no compiler is at hand, `load()` returns None and
callers keep the pure-torch path.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
DISABLE_ENV = "INFERENCE_DISABLE_CPU_KERNELS"


@lru_cache(maxsize=1)
def load():
    """The compiled module, or None (disabled by env, or the build failed)."""
    if os.environ.get(DISABLE_ENV):
        return None
    try:
        from torch.utils.cpp_extension import load as build
        build_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
        # One build per environment: torch's builder keys its cache on the include paths, so
        # two virtual environments sharing a folder would rebuild each other's module forever.
        env_key = hashlib.sha1(f"{sys.prefix}|{torch.__version__}".encode()).hexdigest()[:12]
        build_dir = build_dir / "inference_cluster" / env_key
        build_dir.mkdir(parents=True, exist_ok=True)
        log.info("loading our CPU kernels (compiled on first use, about a minute)")
        return build(name="inference_cpu_kernels", sources=[str(_SOURCE)], build_directory=str(build_dir),
                     extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                     verbose=False)
    except Exception as exc:  # no compiler, no ninja, ...: the torch path still works
        log.warning("CPU kernels unavailable (%s); using the torch attention path", exc)
        return None


def for_tensors(*tensors):
    """The compiled module when every tensor is float32 on the CPU (what the kernels
    take), else None: the one check every caller makes before using a kernel."""
    if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return load()
    return None
