"""The environment a model process sets before torch loads: settings torch reads once, when CUDA
starts (PYTORCH_CUDA_ALLOC_CONF) or at its first CPU allocation (THP_MEM_ALLOC_ENABLE), so they
cannot be changed once the engine exists. Imports no torch."""
from __future__ import annotations

import os
from collections.abc import MutableMapping

# torch's CPU allocator, with this set, aligns every allocation of 2 MiB or more to 2 MiB and
# asks the kernel for transparent huge pages there (madvise) before it is first touched.
TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
TORCH_CUDA_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def model_process_environment(cpu_huge_pages: bool, cuda_alloc_conf: str = "") -> dict[str, str]:
    """The variables a model process with these worker settings runs under."""
    env = {}
    if cpu_huge_pages:
        env[TORCH_HUGE_PAGES] = "1"
    if cuda_alloc_conf:
        env[TORCH_CUDA_ALLOC_CONF] = cuda_alloc_conf
    return env


def apply_model_process_environment(cpu_huge_pages: bool, cuda_alloc_conf: str = "",
                                    environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Sets them where the environment does not already (an operator's own value wins); returns
    what the process now runs under for each."""
    for name, value in model_process_environment(cpu_huge_pages, cuda_alloc_conf).items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in (TORCH_HUGE_PAGES, TORCH_CUDA_ALLOC_CONF) if name in environ}


def anon_huge_page_bytes(smaps_rollup: str = "/proc/self/smaps_rollup") -> int | None:
    """This process's anonymous memory on transparent huge pages now, or None where the kernel
    does not say (not Linux, or no smaps_rollup)."""
    try:
        with open(smaps_rollup) as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
