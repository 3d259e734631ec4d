"""CURVE tests' shared ground: a short temporary folder (for unix socket paths), a config for a run
dir and endpoint, and a file's permission bits."""
from __future__ import annotations

import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from shared.config import load_config


def short_temp_dir() -> Iterator[Path]:
    """A short temporary folder: unix socket paths are limited to about 100 bytes."""
    path = Path(tempfile.mkdtemp(prefix="cv-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def config_for(run_dir: Path, endpoint: str = "", **overrides):
    return load_config(None, {"run_dir": str(run_dir), "gateway.worker_endpoint": endpoint, **overrides})


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)
