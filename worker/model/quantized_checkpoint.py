"""Quantized checkpoints: write a quantized model as a folder, and build a model from one.

The format is ours and versioned. `config.json` is the source's with a `quantization_config`
block (`quant_method` "inference-cluster-woq", the rule, and per quantized projection its
bits, group size and which optional tensors it has); `model.safetensors` holds the state
under our own module names: QuantizedLinear buffers as stored, every float parameter in the
source checkpoint's dtype. Tokenizer and other files are copied, so the folder serves as is.

Loading (worker/model/weights.py calls the two functions at the end) puts QuantizedLinear
shells where the config says before the model is materialised, then fills them, so a model
that only fits quantized never exists in float.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from worker.model.config import OUR_QUANT_METHOD
from worker.model.quantization import QuantizationPlan, QuantizedLinear
from worker.model.quantize_model import QuantizationReport
from worker.model.transformer import Transformer

QUANT_METHOD = OUR_QUANT_METHOD
FORMAT_VERSION = 1
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def quantization_config(model_dir: Path) -> dict | None:
    """The folder's quantization_config if it is one of ours, else None."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    config = hf.get("quantization_config")
    return config if config and config.get("quant_method") == QUANT_METHOD else None


def save_quantized_checkpoint(model: Transformer, report: QuantizationReport, source_dir: Path, out_dir: Path,
                              rule_text: str, calibration_info: dict | None = None) -> Path:
    """Write `model` (already quantized in place, `report` from quantize_model) to out_dir."""
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    if out_dir.resolve() == source_dir.resolve():
        raise ValueError("the quantized checkpoint must go to a folder other than its source")
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in source_dir.iterdir():
        if path.is_file() and path.name not in _WEIGHT_FILES and not path.name.startswith("model-"):
            shutil.copy2(path, out_dir / path.name)
    hf = json.loads((source_dir / "config.json").read_text())
    float_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(model.config.dtype, torch.float32)
    hf["quantization_config"] = dict(
        quant_method=QUANT_METHOD, version=FORMAT_VERSION, rule=rule_text, layers=report.layers,
        calibration=calibration_info or None)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("rotary.") or (model.config.tie_word_embeddings and name == "lm_head.weight"):
            continue  # rebuilt at load / shared with the embedding
        owner = name.rsplit(".", 1)[0]
        is_quantized_buffer = owner in report.layers and not name.endswith(".bias")
        tensor = tensor.detach().cpu()
        tensors[name] = (tensor if is_quantized_buffer or not tensor.is_floating_point()
                         else tensor.to(float_dtype)).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt", "quant_method": QUANT_METHOD})
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out_dir


def install_quantized_shells(model: Transformer, qconfig: dict, dtype: torch.dtype) -> None:
    """Replace each projection the checkpoint stores quantized by an empty QuantizedLinear
    (on the meta device while the model is still there), before the model is materialised."""
    if qconfig.get("version") != FORMAT_VERSION:
        raise ValueError(f"quantized checkpoint has format version {qconfig.get('version')}; "
                         f"this worker reads version {FORMAT_VERSION}")
    for name, layer in qconfig["layers"].items():
        parent_name, _, attribute = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
        except AttributeError:
            parent = None
        if not isinstance(getattr(parent, attribute, None), nn.Linear):
            raise ValueError(f"quantized checkpoint names {name!r}, which is not a projection of this model")
        with torch.device("meta"):
            shell = QuantizedLinear.empty(layer["bits"], tuple(layer["shape"]), layer["group_size"],
                                          layer["has_bias"], layer["has_input_scale"], dtype)
        setattr(parent, attribute, shell)


def load_quantized_state(model: Transformer, model_dir: Path, measure_paths: bool = True) -> None:
    """Fill a materialised model (shells installed) from the quantized checkpoint's tensors; its
    quantized layers then share a QuantizationPlan of their own."""
    state = model.state_dict()
    tied = model.config.tie_word_embeddings
    expected = {n for n in state if not n.startswith("rotary.")} - ({"lm_head.weight"} if tied else set())
    found = set()
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt", device="cpu") as f:
        for name in f.keys():
            if name not in expected:
                raise ValueError(f"quantized checkpoint {model_dir} has an unexpected tensor {name!r}")
            tensor = f.get_tensor(name)
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(state[name].shape)}")
            with torch.no_grad():
                state[name].copy_(tensor)  # casts float tensors to the model's dtype; moves to its device
            found.add(name)
    missing = sorted(expected - found)
    if missing:
        raise ValueError(f"quantized checkpoint {model_dir} is missing tensors: {missing[:8]}")
    plan = QuantizationPlan()
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.plan = plan
            if measure_paths:
                plan.choose_paths(module)
