"""The engine's settings: one frozen, stdlib-only definition, checked when built.

The `[worker]` TOML section parses into `WorkerConfig` (shared/config.py), which is an
`EngineConfig` plus the worker process's own settings, so the engine reads the TOML's values
directly; `Engine.from_model_dir(dir, **overrides)` builds the same class from the same names.
Every check of a setting lives here, and a bad value fails before any weight is read.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from shared.quantization_rule import DEFAULT_GROUP_SIZE, PRESETS, QuantizationRule
from shared.sampling_params import MAX_SPECULATIVE_NGRAM_K

LOAD_MODES = ("full", "sharded", "on_demand")
ATTENTION_IMPLS = ("fast", "reference")
DTYPES = ("float32", "float16", "bfloat16")
_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "meta")
_DEVICE = re.compile(rf"({'|'.join(_DEVICE_TYPES)})(:[0-9]+)?")
# An n-gram longer than this adds index work without finding copies a shorter one misses.
MAX_SPECULATIVE_NGRAM_N = 16


class ConfigError(ValueError):
    """A config file, flag or setting that is malformed, unknown or out of range; the message names it."""


def check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name} must be {allowed}, got {value!r}")


def device_type(name: str) -> str | None:
    """The device type of a torch device string ("cuda:1" -> "cuda"), None if it is not one."""
    match = _DEVICE.fullmatch(name)
    return match.group(1) if match else None


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"  # "auto": cuda if available, else cpu
    # "": on the CPU the checkpoint's half type for a bf16 or fp16 checkpoint, else float32; on CUDA
    # the checkpoint's half type. bfloat16 or float16 on the CPU stores the weights so and computes in
    # float32.
    dtype: str = ""
    num_threads: int = 0  # torch CPU threads; 0 leaves torch's default (the worker process sets it)
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: size the pool from memory
    kv_cache_bytes: int = 256 << 20  # CPU: the KV pool's byte budget
    # The KV pool's element type; "" = the model's compute dtype. A half type holds twice the
    # tokens in the same memory; attention reads it widened to the compute dtype. float16 overflows
    # past 65504 (NaN logits: the request fails), bfloat16 keeps float32's range.
    kv_cache_dtype: str = ""
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory the worker may use
    max_num_seqs: int = 32
    # Tokens one step computes, decodes and prompt chunks together: a step's length, so also how
    # long running decodes wait behind new prompts (a longer prompt takes several steps).
    max_num_batched_tokens: int = 512
    # Most prompt tokens one request computes in a step: bounds how long decodes wait behind a
    # long prompt. 0: the whole step budget.
    max_prefill_chunk_tokens: int = 0
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention: str = "fast"  # "fast" or "reference" (the per-sequence loop the tests trust)
    # CUDA: decode steps, and steps verifying speculative drafts, replay captured graphs (one per
    # batch, context-width and draft-length bucket); a step's many small kernels then cost one
    # launch (worker/decode_graphs.py).
    cuda_graphs: bool = True
    seed: int | None = None  # for requests without a seed of their own
    # Weight placement (worker/model/placement.py): "full" (every weight on `device`), "sharded"
    # (layers split in pipeline stages over `devices`) or "on_demand" (weights in host memory, each
    # layer copied to the device as it runs: a model bigger than the device, slower).
    load_mode: str = "full"
    devices: tuple[str, ...] = ()  # sharded only, e.g. ["cuda:0", "cuda:1"]: one per stage, in order
    quantization: str = "none"  # weight-only: none, int8, int4 or mixed (attention int8, MLP int4)
    quantization_group_size: int = DEFAULT_GROUP_SIZE  # INT4 group size
    quantization_symmetric: bool = False  # INT4 without zero points
    quantization_rule: str = ""  # replaces mixed's "attention:int8,mlp:int4", e.g. "params>=1e6:int8,*:int4"
    # Activation-aware scales from "self" (the model's own samples), a text file, or "none"
    # (plain rounding). Saved beside the checkpoint (or in ~/.cache) and reused at the next start.
    quantization_calibration: str = "self"
    # "int8": the quantized layers also quantize their input per 32-block to int8 and take integer
    # dot products (llama.cpp's q8_0 x q8_0 arithmetic: faster on the CPU, with activation
    # rounding on top of the weights'). "float32": weight-only, activations exact.
    quantization_activations: str = "float32"
    # Speculative decoding by prompt lookup (worker/speculative.py): each decode step proposes up
    # to k tokens copied from where the sequence's last n tokens (max_n down to min_n) occurred
    # before, and verifies them in the same forward. The default k of requests that do not choose
    # (0 = off); a request may ask for up to speculative_ngram_max_k (0 there: off for every request).
    speculative_ngram_k: int = 0
    speculative_ngram_max_k: int = 8
    speculative_ngram_min_n: int = 2
    speculative_ngram_max_n: int = 4
    # Drafts fill a step only up to this many tokens, decodes included (0: no cap). Past it a forward
    # is compute-bound, so a draft token costs about what it may save: a big batch gains nothing. 16
    # is about where a CPU step of bench-small stops being bound by its weight stream (docs/benchmarks.md);
    # a GPU has room for hundreds.
    speculative_ngram_max_step_tokens: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))  # a list from TOML or a caller
        self.validate()

    def validate(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            check(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        for name in ("num_threads", "num_kv_blocks", "kv_cache_bytes", "max_prefill_chunk_tokens", "max_model_len"):
            check(getattr(self, name) >= 0, name, getattr(self, name), ">= 0")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization,
              "in (0, 1]")
        check(self.device == "auto" or device_type(self.device) is not None, "device", self.device,
              f"auto or a device ({', '.join(_DEVICE_TYPES)}, optionally :N)")
        check(self.dtype in ("", *DTYPES), "dtype", self.dtype,
              'empty (the device\'s default), "float32", "float16" or "bfloat16"')
        check(self.kv_cache_dtype in ("", *DTYPES), "kv_cache_dtype", self.kv_cache_dtype,
              'empty (the model\'s compute dtype), "float32", "float16" or "bfloat16"')
        check(self.attention in ATTENTION_IMPLS, "attention", self.attention, "one of " + ", ".join(ATTENTION_IMPLS))
        check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)), "seed",
              self.seed, "an integer or unset")
        self._validate_load_mode()
        self._validate_quantization()
        self._validate_speculation()

    def _validate_load_mode(self) -> None:
        check(self.load_mode in LOAD_MODES, "load_mode", self.load_mode, f"one of {list(LOAD_MODES)}")
        if self.load_mode != "sharded":
            check(not self.devices, "devices", self.devices,
                  f"empty unless load_mode is sharded: devices are only for load_mode 'sharded' (load_mode is "
                  f"{self.load_mode!r}; use `device` for one device)")
            return
        check(len(self.devices) >= 2, "devices", self.devices,
              "at least 2 devices with load_mode 'sharded' (one per pipeline stage)")
        types = set()
        for i, name in enumerate(self.devices):
            kind = device_type(name) if isinstance(name, str) else None
            check(kind is not None, f"devices[{i}]", name, f"a device ({', '.join(_DEVICE_TYPES)}, optionally :N): "
                  f"devices[{i}] = {name!r} is not a device")
            types.add(kind)
        # One dtype, one sampler and one kind of memory accounting per worker.
        check(len(types) == 1, "devices", self.devices, "sharded devices that must all be of one type")
        check(self.device == "auto" or device_type(self.device) in types, "device", self.device,
              f"auto with load_mode 'sharded' (the first of devices takes the inputs); {self.device!r} "
              f"contradicts devices={self.devices}")

    def _validate_quantization(self) -> None:
        check(self.quantization in PRESETS, "quantization", self.quantization, f"one of {sorted(PRESETS)}")
        check(self.quantization_activations in ("float32", "int8"), "quantization_activations",
              self.quantization_activations, '"float32" (weight-only) or "int8"')
        check(self.quantization_group_size >= 2 and self.quantization_group_size % 2 == 0,
              "quantization_group_size", self.quantization_group_size, "an even number >= 2")
        check(self.quantization_calibration in ("self", "none") or os.path.isfile(self.quantization_calibration),
              "quantization_calibration", self.quantization_calibration, "self, none or an existing text file")
        # The rule replaces the mixed preset's clauses; beside any other preset it would do nothing.
        check(not self.quantization_rule or self.quantization == "mixed", "quantization_rule", self.quantization_rule,
              f'empty unless quantization = "mixed" (it is {self.quantization!r})')
        try:
            self.quantization_rule_parsed()
        except ValueError as e:
            raise ConfigError(f"quantization_rule must be a valid rule, got {self.quantization_rule!r}: {e}") from None

    def _validate_speculation(self) -> None:
        check(0 <= self.speculative_ngram_max_k <= MAX_SPECULATIVE_NGRAM_K, "speculative_ngram_max_k",
              self.speculative_ngram_max_k, f"in [0, {MAX_SPECULATIVE_NGRAM_K}]")
        check(0 <= self.speculative_ngram_k <= self.speculative_ngram_max_k, "speculative_ngram_k",
              self.speculative_ngram_k, f"in [0, speculative_ngram_max_k={self.speculative_ngram_max_k}]")
        check(self.speculative_ngram_max_step_tokens >= 0, "speculative_ngram_max_step_tokens",
              self.speculative_ngram_max_step_tokens, ">= 0")
        check(1 <= self.speculative_ngram_min_n <= MAX_SPECULATIVE_NGRAM_N, "speculative_ngram_min_n",
              self.speculative_ngram_min_n, f"in [1, {MAX_SPECULATIVE_NGRAM_N}]")
        check(self.speculative_ngram_min_n <= self.speculative_ngram_max_n <= MAX_SPECULATIVE_NGRAM_N,
              "speculative_ngram_max_n", self.speculative_ngram_max_n,
              f"in [speculative_ngram_min_n={self.speculative_ngram_min_n}, {MAX_SPECULATIVE_NGRAM_N}]")

    def quantization_rule_parsed(self) -> QuantizationRule:
        return QuantizationRule.preset(self.quantization, self.quantization_rule or None,
                                       group_size=self.quantization_group_size, symmetric=self.quantization_symmetric)
