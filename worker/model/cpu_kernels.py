"""Our C++ CPU kernels, compiled on first use with torch's extension builder.

Only where they measurably pay (see docs/benchmarks.md): the packed-panel and quantized
linears, paged attention reading K/V through block tables in place, greedy argmax, small
fused ops, sampling's penalty and draw, and every decoder layer of a step in one call. Their callers are the CPU fast path
(worker/model/cpu_fast_path.py), the quantized linears' "ours" path and greedy sampling, each
choosing once. If no compiler is at hand, `load()` returns None and the pure-torch paths run.
Concurrent first starts (two workers) and starts after a builder was killed are safe.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import sys
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_SOURCE_DIR = Path(__file__).with_name("csrc")
_SOURCES = ("bindings.cpp", "decode_attention.cpp", "prefill_attention.cpp", "linear.cpp", "pointwise.cpp",
            "rotary.cpp", "decoder_layers.cpp", "linear_int8_activations.cpp", "sampling.cpp")
DISABLE_ENV = "INFERENCE_DISABLE_CPU_KERNELS"
TORCH_BUILD_LOCK = "lock"  # the file torch.utils.cpp_extension's builder holds while it builds
BUILT_STAMP = "built.json"  # the build's key (sources, flags, Python) and the module a finished build made


def build_dir() -> Path:
    """Where this environment's module is built and cached. One build per environment and source
    tree: torch's builder keys its cache on the include and source paths, so two virtual
    environments, or two checkouts run by one environment, sharing a folder would rebuild each
    other's module forever (each start waiting minutes on the other's build)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    env_key = hashlib.sha1(f"{sys.prefix}|{torch.__version__}|{_SOURCE_DIR.resolve()}".encode()).hexdigest()[:12]
    return root / "inference_cluster" / env_key


@lru_cache(maxsize=1)
def load():
    """The compiled module, or None (disabled by env, or the build failed)."""
    if os.environ.get(DISABLE_ENV):
        return None
    try:
        folder, sources = build_dir(), _sources_hash()
        cflags, ldflags = ["-O3", "-march=native", "-fopenmp", f"-DKERNEL_SOURCES={sources}"], ["-fopenmp"]
        # What torch's builder would rebuild for, beyond what names the folder (environment, torch,
        # source tree): the sources, the flags, the file list, the Python and compiler it builds with.
        key = hashlib.sha1(json.dumps([sources, cflags, ldflags, _SOURCES, sys.version,
                                       os.environ.get("CXX", "")]).encode()).hexdigest()[:16]
        if (module := _load_built(folder, key)) is not None:
            return module
        from torch.utils.cpp_extension import load as build
        folder.mkdir(parents=True, exist_ok=True)
        log.info("loading our CPU kernels (compiled on first use, about a minute)")
        with _build_guard(folder):
            # No start may take the module by the stamp while the builder may be replacing it.
            (folder / BUILT_STAMP).unlink(missing_ok=True)
            module = build(name="inference_cpu_kernels", sources=[str(_SOURCE_DIR / name) for name in _SOURCES],
                           build_directory=str(folder), extra_cflags=cflags, extra_ldflags=ldflags, verbose=False)
            try:
                _write_built_stamp(folder, key, module)
            except OSError as exc:  # the next start goes through the builder again: slower, no worse
                log.warning("could not record the CPU kernels' build (%s)", exc)
            return module
    except Exception as exc:  # no compiler, no ninja, ...: the torch path still works
        log.warning("CPU kernels unavailable (%s); using the torch attention path", exc)
        return None


def _load_built(folder: Path, key: str):
    """The module torch's builder last made in `folder` for this `key` (of the sources and everything
    else the build depends on), loaded directly, or None.
    The builder's import alone brings torch's compiler stack with it: over a second of every
    worker's start, for a module that is already built."""
    try:
        stamp = json.loads((folder / BUILT_STAMP).read_text())
    except (OSError, ValueError):
        return None
    path = Path(stamp.get("module", ""))
    if stamp.get("key") != key or not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(stamp["name"], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # whatever the module no longer loads against: the builder remakes it
        log.warning("the built CPU kernels at %s do not load (%s); building them again", path, exc)
        return None
    return module


def _write_built_stamp(folder: Path, key: str, module) -> None:
    partial = folder / f"{BUILT_STAMP}.{os.getpid()}"
    try:
        partial.write_text(json.dumps({"key": key, "name": module.__name__, "module": module.__file__}))
        os.replace(partial, folder / BUILT_STAMP)  # whole or absent for a start reading it unlocked
    finally:
        partial.unlink(missing_ok=True)


def int4_row_tiles(kernels) -> list[str]:
    """The one-row INT4 tiles this build of `kernels` has, each a choice `int4_row_kernel` takes
    ("fma" always; "bf16" and "vnni" where the compiler targeted them, "int8" on AVX2 builds without
    the AVX-512 kernels); the choice is left as it was."""
    chosen, tiles = kernels.int4_row_kernel(), ["fma"]
    for tile in ("bf16", "vnni", "int8"):
        try:
            kernels.int4_row_kernel(tile)
            tiles.append(tile)
        except RuntimeError:
            pass
    if kernels.int4_row_kernel("auto") != chosen:
        kernels.int4_row_kernel(chosen)
    return tiles


def _sources_hash() -> str:
    """A digest of every file in csrc/, headers included: torch's builder rebuilds when its build
    arguments change, and only hashes the .cpp files itself."""
    digest = hashlib.sha1()
    for path in sorted(_SOURCE_DIR.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


@contextmanager
def _build_guard(build_dir: Path):
    """One of our processes at a time in torch's builder, under a lock the kernel releases if
    its holder dies. torch's own lock is a plain file: a process killed while building or
    loading (two workers start together; one is killed) leaves it behind, and every later
    start would wait on it forever. Holding ours, any such file is stale, and is removed."""
    with open(build_dir / "inference.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = build_dir / TORCH_BUILD_LOCK
        if stale.exists():
            log.warning("removing %s, left by a process that died while building the CPU kernels", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
