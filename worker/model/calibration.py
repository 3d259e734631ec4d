"""Activation-aware calibration for weight-only quantization, without labelled data.

Owns what calibration needs below the engine: the prompts the model writes its own
calibration set from (the seeds' recipe: a handful of prompts, several samples each) or the
windows of a given text file; the per-input-channel activation statistics of every
projection, recorded with forward hooks; the search for each projection's input scales; and
the file that keeps the result beside the checkpoint so the next start reuses it.

The scaling is AWQ's idea (Lin et al., 2023), implemented from its description: a channel
whose activations are large matters more to the output, so the weight's column for it is
multiplied by s = mean|x|^alpha before rounding (rounded more finely relative to its size)
and the input is divided by s at run time. alpha is searched per layer on the recorded
activations; alpha = 0 is plain rounding, so the search never picks worse than that.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from shared.engine_config import ConfigError
from worker.model.quantized_weight import dequantize, quantize
from worker.model.quantize_model import QuantizationRule, quantization_targets

log = logging.getLogger(__name__)

# Varied openings (prose, instructions, code, lists) so the samples cover more than one register.
DEFAULT_PROMPTS = (
    "The", "Once upon a time", "Return the number of", "def main():", "import os\n", "The function",
    "In this section we", "class Config:", "Raise an error if", "1. First,", "Question: what is",
    "Note that the", "for i in range(", "The following example shows", "# Read the file", "This module",
)
_FILE_VERSION = 1


@dataclass(frozen=True)
class CalibrationSettings:
    source: str = "self"  # "self": the model's own samples; else a path to a text file
    num_prompts: int = 8
    samples_per_prompt: int = 4
    max_new_tokens: int = 96
    seed: int = 0
    max_rows: int = 512  # activation rows kept per projection for the search
    grid: int = 11  # alphas tried, evenly spaced in [0, 1]

    def __post_init__(self):
        if self.source != "self" and not Path(self.source).is_file():
            raise ValueError(f"calibration source must be 'self' or an existing text file, got {self.source!r}")
        for name in ("num_prompts", "samples_per_prompt", "max_new_tokens", "max_rows", "grid"):
            if getattr(self, name) < 1:
                raise ValueError(f"calibration {name} must be >= 1, got {getattr(self, name)}")

    def key(self) -> str:
        fields = asdict(self)
        if self.source != "self":
            fields["source"] = hashlib.sha256(Path(self.source).read_bytes()).hexdigest()
        return json.dumps(fields, sort_keys=True)


# ---- the calibration set ----------------------------------------------------------------------
def _tokenizer(model_dir: Path):
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer  # only the worker's calibration needs it, and only here
    return Tokenizer.from_file(str(path))


def calibration_prompts(model_dir: Path, settings: CalibrationSettings, vocab_size: int,
                        bos_token_id: int | None) -> list[list[int]]:
    """Token-id prompts for self-generation: the default prompts through the model's
    tokenizer, or, without one, single random tokens (a data-free start)."""
    tokenizer = _tokenizer(model_dir)
    bos = [bos_token_id] if bos_token_id is not None else []
    if tokenizer is not None:
        prompts = [bos + tokenizer.encode(text, add_special_tokens=False).ids for text in DEFAULT_PROMPTS]
        return [p for p in prompts if len(p) > len(bos)][:settings.num_prompts]
    generator = torch.Generator().manual_seed(settings.seed)
    starts = torch.randint(0, vocab_size, (settings.num_prompts,), generator=generator).tolist()
    return [bos + [t] for t in starts]


def text_file_windows(model_dir: Path, settings: CalibrationSettings, window: int) -> list[list[int]]:
    """Consecutive windows of the given text file, as many as self-generation would make. A file
    or model that cannot give any is a ConfigError naming quantization_calibration's file."""
    source = settings.source
    tokenizer = _tokenizer(model_dir)
    if tokenizer is None:
        raise ConfigError(f"quantization_calibration {source}: calibrating from a text file needs the model's "
                          f"tokenizer.json in {model_dir}")
    try:
        text = Path(source).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"quantization_calibration {source} is not UTF-8 text ({e.reason} at byte {e.start})"
                          ) from None
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) >= 2][:settings.num_prompts * settings.samples_per_prompt]
    if not windows:
        raise ConfigError(f"quantization_calibration {source} holds fewer than 2 tokens")
    return windows


# ---- activation statistics ---------------------------------------------------------------------
@dataclass
class ActivationStats:
    """Per input channel mean |x| over every row seen, and a uniform sample of the rows."""
    abs_sum: torch.Tensor
    num_rows: int = 0
    rows: torch.Tensor | None = None  # [<= max_rows, K] float32
    keys: torch.Tensor | None = None  # the random key of each kept row

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.num_rows, 1)

    def add(self, x: torch.Tensor, max_rows: int, generator: torch.Generator) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float().cpu()
        self.abs_sum += x.abs().sum(dim=0, dtype=torch.float64)
        self.num_rows += x.shape[0]
        # Keep the rows with the smallest random keys: a uniform sample without replacement
        # of everything seen, whatever order the rows came in.
        keys = torch.rand(x.shape[0], generator=generator)
        rows = x if self.rows is None else torch.cat([self.rows, x])
        keys = keys if self.keys is None else torch.cat([self.keys, keys])
        if rows.shape[0] > max_rows:
            keep = keys.topk(max_rows, largest=False).indices
            rows, keys = rows[keep], keys[keep]
        self.rows, self.keys = rows, keys


@contextmanager
def record_activations(model: nn.Module, max_rows: int, seed: int = 0) -> Iterator[dict[str, ActivationStats]]:
    """Within the block, every forward of a quantization target adds its input to the stats."""
    stats: dict[str, ActivationStats] = {}
    generator = torch.Generator().manual_seed(seed)
    handles = []
    for name, _, _, linear in quantization_targets(model):
        stats[name] = ActivationStats(torch.zeros(linear.in_features, dtype=torch.float64))

        def hook(module, args, output, name=name):
            stats[name].add(args[0], max_rows, generator)
        handles.append(linear.register_forward_hook(hook))
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()


# ---- the search ------------------------------------------------------------------------------
def search_input_scale(weight: torch.Tensor, stats: ActivationStats, bits: int, group_size: int,
                       symmetric: bool, grid: int) -> tuple[torch.Tensor, float, float, float]:
    """(input_scale = 1/s, alpha, relative output error at alpha = 0, at the chosen alpha)."""
    w = weight.detach().float().cpu()
    x = stats.rows
    reference = x @ w.t()
    norm = reference.pow(2).mean().clamp(min=1e-20)
    mean_abs = stats.mean_abs.float().clamp(min=1e-5)
    best = None
    for alpha in torch.linspace(0, 1, grid).tolist():
        s = mean_abs.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centred on 1, so neither end of the range drifts
        approx = dequantize(quantize(w * s[None, :], bits, group_size, symmetric)) / s[None, :]
        error = ((x @ approx.t() - reference).pow(2).mean() / norm).item()
        if alpha == 0:
            plain = error
        if best is None or error < best[2]:
            best = (s, alpha, error)
    s, alpha, error = best
    return 1.0 / s, alpha, plain, error


@dataclass
class Calibration:
    input_scales: dict[str, torch.Tensor]  # module name -> 1/s per input channel
    alphas: dict[str, float] = field(default_factory=dict)
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)  # (plain, chosen) relative error
    info: dict = field(default_factory=dict)  # rule, settings, tokens, seconds, fingerprint

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        meta = dict(version=str(_FILE_VERSION), alphas=json.dumps(self.alphas), errors=json.dumps(self.errors),
                    info=json.dumps(self.info))
        save_file({name: t.contiguous() for name, t in self.input_scales.items()}, str(tmp), metadata=meta)
        tmp.chmod(0o644)  # a shared cache other users' workers may read
        os.replace(tmp, path)  # whole or absent: a worker killed mid-write leaves no torn file

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        """The calibration saved in `path`; ValueError naming it if the file is not one of ours
        whole (torn by a copy, another version, another program's safetensors)."""
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            if meta.get("version") != str(_FILE_VERSION):
                raise ValueError(f"calibration file {path} has version {meta.get('version')}, "
                                 f"expected {_FILE_VERSION}")
            errors = {k: tuple(v) for k, v in json.loads(meta["errors"]).items()}
            return cls(load_file(str(path)), json.loads(meta["alphas"]), errors, json.loads(meta["info"]))
        # SafetensorError derives from Exception alone; the others are metadata of the wrong shape.
        except (SafetensorError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"calibration file {path} does not read as one: {type(e).__name__}: {e}") from e

    def summary(self) -> str:
        if not self.errors:
            return "no layers"
        plain = sum(e[0] for e in self.errors.values()) / len(self.errors)
        chosen = sum(e[1] for e in self.errors.values()) / len(self.errors)
        return (f"{len(self.errors)} layers, mean relative output error {plain:.2e} plain -> {chosen:.2e} "
                f"scaled ({(1 - chosen / plain) if plain else 0:.0%} less), mean alpha "
                f"{sum(self.alphas.values()) / len(self.alphas):.2f}")


def search_model(model: nn.Module, stats: dict[str, ActivationStats], rule: QuantizationRule,
                 grid: int) -> Calibration:
    """Input scales for every projection the rule quantizes and the calibration reached."""
    calibration = Calibration({})
    for name, _, _, linear in quantization_targets(model):
        bits = rule.bits_for(name, linear.weight)
        if bits is None or stats.get(name) is None or stats[name].rows is None:
            continue
        scale, alpha, plain, chosen = search_input_scale(linear.weight, stats[name], bits, rule.group_size,
                                                         rule.symmetric, grid)
        calibration.input_scales[name] = scale
        calibration.alphas[name] = alpha
        calibration.errors[name] = (plain, chosen)
    return calibration


# ---- where results are kept ------------------------------------------------------------------
def checkpoint_fingerprint(model_dir: Path) -> str:
    """Identifies a checkpoint's contents cheaply: config.json, and per weight file its size,
    safetensors header and first and last MiB (hashing many GB whole would cost a minute)."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()


def calibration_file_name(model_dir: Path, rule: QuantizationRule, settings: CalibrationSettings) -> str:
    key = hashlib.sha256(f"{rule.text}|{settings.key()}".encode()).hexdigest()[:16]
    return f"awq-{checkpoint_fingerprint(model_dir)[:16]}-{key}.safetensors"


def calibration_dirs(model_dir: Path) -> list[Path]:
    """Beside the checkpoint first; a per-user cache for a folder we may not write to."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "inference_cluster" / "calibration"
    return [model_dir / "calibration", cache]


def find_calibration(model_dir: Path, name: str) -> Path | None:
    return next((d / name for d in calibration_dirs(model_dir) if (d / name).is_file()), None)


def save_calibration(calibration: Calibration, model_dir: Path, name: str) -> Path:
    """Save to the first place that takes it; returns where."""
    errors = []
    for directory in calibration_dirs(model_dir):
        try:
            calibration.save(directory / name)
            return directory / name
        except OSError as e:
            errors.append(f"{directory}: {e}")
    raise OSError(f"could not save calibration {name}: {'; '.join(errors)}")


def describe_sequences(sequences: Sequence[Sequence[int]]) -> dict:
    lengths = [len(s) for s in sequences]
    return dict(num_sequences=len(lengths), num_tokens=sum(lengths),
                mean_length=round(sum(lengths) / max(len(lengths), 1), 1), max_length=max(lengths, default=0))


def now_info(started: float) -> dict:
    return dict(seconds=round(time.perf_counter() - started, 2), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                torch=torch.__version__)
