"""Build a Transformer from a local Hugging Face folder: config, then safetensors weights.

Maps Hugging Face parameter names to ours, fusing q/k/v and gate/up. Reads files with
memory-mapped safetensors; never downloads, never uses transformers' modelling code.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from worker.model.config import CheckpointError, MissingCheckpointFileError, ModelConfig
from worker.model.placement import WeightPlacement
from worker.model.quantized_checkpoint import install_quantized_shells, load_quantized_state, quantization_config
from worker.model.transformer import Transformer

log = logging.getLogger(__name__)

# Checkpoint entries that carry nothing we need (older Llama exports store RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Our fused parameter -> the checkpoint's parts, concatenated along the output dim.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def resolve_dtype(requested: str | torch.dtype | None, device: torch.device, config: ModelConfig) -> torch.dtype:
    """The dtype weights are stored in, unless asked: on the CPU the checkpoint's half type for a
    bf16 or fp16 checkpoint (computed in float32, so nothing is lost against it, and half the bytes
    to read), else float32; on CUDA the checkpoint's half type, else bfloat16."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested not in (None, "auto"):
        dtype = getattr(torch, str(requested), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"unsupported dtype {requested!r}; use float32, bfloat16 or float16")
        return dtype
    if device.type == "cpu":
        return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(config.dtype, torch.float32)
    return torch.float16 if config.dtype == "float16" else torch.bfloat16


def compute_dtype_for(storage: torch.dtype, device: torch.device) -> torch.dtype:
    """What a model whose weights are stored in `storage` computes in: float32 for bfloat16 and
    float16 weights on the CPU (our kernels widen them in registers; half-precision arithmetic is
    slow there and rounds every activation), else the storage dtype."""
    return torch.float32 if device.type == "cpu" and storage in (torch.bfloat16, torch.float16) else storage


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{index} does not read as a JSON object: {e}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index} has no 'weight_map' of tensor names to shard files")
        shards = [model_dir / name for name in sorted(set(weight_map.values()))]
        if absent := [path.name for path in shards if not path.is_file()]:
            raise MissingCheckpointFileError(f"{index} names shards that are not in {model_dir}: {absent[:4]}")
        return shards
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise MissingCheckpointFileError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir} "
        "(only safetensors checkpoints are supported)")


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype=None,
               max_positions: int | None = None, placement: WeightPlacement | None = None,
               config: ModelConfig | None = None) -> Transformer:
    """Load onto `device`, or where `placement` puts each part (worker/model/placement.py). The
    layer loop of a sharded or on-demand plan is attached afterwards by `attach_placement`, so
    that whatever rewrites layers in between (quantization) sees ordinary modules. The layers of
    a quantized checkpoint share one QuantizationPlan of their own. `config`: the folder's
    ModelConfig where the caller has read it already (it reads config.json and tokenizer.json)."""
    model_dir = Path(model_dir)
    config = config or ModelConfig.from_model_dir(model_dir)
    plan = placement or WeightPlacement.single(device, config.num_layers)
    if len(plan.layer_devices) != config.num_layers:
        raise ValueError(f"placement has {len(plan.layer_devices)} layers, the model {config.num_layers}")
    # The compute device decides the dtype, also for layers parked in host memory (on_demand).
    dtype = resolve_dtype(dtype, plan.compute_device, config)
    compute_dtype = compute_dtype_for(dtype, plan.compute_device)
    started = time.perf_counter()
    # Build on the meta device so no memory is spent on a random init we overwrite.
    with torch.device("meta"):
        model = Transformer(config, max_positions).to(compute_dtype)
        if dtype != compute_dtype:
            model.store_weights_in(dtype)
    qconfig = quantization_config(model_dir)  # a checkpoint tools/quantize_checkpoint.py wrote
    if qconfig is not None:
        install_quantized_shells(model, qconfig, compute_dtype)
    _materialize(model, plan)
    model.rotary.build_table(plan.embed_device)  # cos/sin stay float32 whatever the model dtype
    if qconfig is not None:
        load_quantized_state(model, model_dir)
    else:
        _load_weights(model, checkpoint_files(model_dir), dtype)
    if config.tie_word_embeddings and plan.head_device != plan.embed_device and isinstance(model.lm_head, torch.nn.Linear):
        # A tied head on another device than the embedding gets its own copy (read-only weights).
        model.lm_head.weight = torch.nn.Parameter(model.embed_tokens.weight.detach().to(plan.head_device))
    model.eval().requires_grad_(False)
    model.load_seconds = time.perf_counter() - started
    stored = dtype if dtype == compute_dtype else f"{dtype} weights, computing in {compute_dtype}"
    log.info("loaded %s (%s, load_mode %s) in %.2f s", model_dir, stored, plan.load_mode, model.load_seconds)
    return model


def _materialize(model: Transformer, plan: WeightPlacement) -> None:
    """Allocate each part's (uninitialised) tensors on its planned device."""
    model.rotary.to_empty(device=plan.embed_device)
    model.embed_tokens.to_empty(device=plan.embed_device)
    for layer, layer_device in zip(model.layers, plan.layer_devices):
        layer.to_empty(device=layer_device)
    model.norm.to_empty(device=plan.head_device)
    model.lm_head.to_empty(device=plan.head_device)
    model.tie_weights()  # `to_empty` re-creates parameters, which unties them


def _our_name(hf_name: str) -> tuple[str, int | None]:
    """HF name -> (our parameter name, index of the part within a fused parameter or None)."""
    name = hf_name.removeprefix("model.")
    for fused, parts in _FUSED.items():
        for i, part in enumerate(parts):
            if f".{part}." in name:
                return name.replace(part, fused), i
    return name, None


def _part_rows(config: ModelConfig, fused: str) -> tuple[int, ...]:
    """The output rows each checkpoint part of a fused parameter has."""
    if "qkv_proj" in fused:
        return config.q_size, config.kv_size, config.kv_size
    return config.intermediate_size, config.intermediate_size


def _load_weights(model: Transformer, files: list[Path], dtype: torch.dtype) -> None:
    params = dict(model.named_parameters())
    pending: dict[str, dict[int, torch.Tensor]] = {}  # fused parts until all have arrived
    loaded: set[str] = set()
    unexpected: list[str] = []
    tied = model.config.tie_word_embeddings
    for path in files:
        try:
            _load_file(model.config, params, path, pending, loaded, unexpected, tied)
        except SafetensorError as e:  # its own errors do not name the file; an OSError may pass (a retry may not)
            raise CheckpointError(f"{path} does not read as safetensors: {e}") from e
    if unexpected:
        raise CheckpointError(f"checkpoint has weights this model does not expect: {sorted(unexpected)[:8]}")
    absent = set(params) - loaded - ({"lm_head.weight"} if tied else set())
    missing = [hf_name for name in sorted(absent) for hf_name in _missing_parts(name, pending.get(name, {}))]
    if missing:
        raise CheckpointError(f"checkpoint is missing weights: {missing[:8]}")


def _missing_parts(name: str, arrived: dict[int, torch.Tensor]) -> list[str]:
    """What of our parameter `name` the checkpoint lacks, by the checkpoint's names: a fused
    parameter's parts that have not arrived, or the parameter itself."""
    for fused, parts in _FUSED.items():
        if fused in name:
            return [f"model.{name.replace(fused, part)}" for i, part in enumerate(parts) if i not in arrived]
    return [name if name.startswith("lm_head.") else f"model.{name}"]


def _load_file(config: ModelConfig, params: dict, path: Path, pending: dict, loaded: set, unexpected: list,
               tied: bool) -> None:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for hf_name in f.keys():
            if hf_name.endswith(_IGNORED_SUFFIXES) or (tied and hf_name == "lm_head.weight"):
                continue
            name, part = _our_name(hf_name)
            if name not in params:
                unexpected.append(hf_name)
                continue
            tensor = f.get_tensor(hf_name)
            if part is None:
                _copy(params[name], tensor, hf_name)
                loaded.add(name)
                continue
            # Each part is checked on its own: a wrong split of the same total rows would
            # pass as the fused whole and load garbage.
            rows = _part_rows(config, name)
            _check_shape(hf_name, tensor, (rows[part], *params[name].shape[1:]))
            parts = pending.setdefault(name, {})
            parts[part] = tensor
            if len(parts) == len(rows):
                _copy(params[name], torch.cat([parts[i] for i in range(len(rows))], dim=0), hf_name)
                loaded.add(name)
                del pending[name]


def _check_shape(hf_name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise CheckpointError(f"weight {hf_name} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")


def _copy(param: torch.nn.Parameter, tensor: torch.Tensor, hf_name: str) -> None:
    _check_shape(hf_name, tensor, tuple(param.shape))
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
