"""ModelConfig: the transformer's shape, read from a Hugging Face `config.json`.

Owns the decision of what we support. Anything we would silently get wrong (sliding
window, mixture of experts, unknown RoPE scaling, other activations) is refused here,
at load, with an error that names the feature.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

# Hugging Face architecture name -> our family name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
# The quant_method our own quantized checkpoints carry (worker/model/quantized_checkpoint.py).
OUR_QUANT_METHOD = "inference-cluster-woq"


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or feature this engine does not implement."""


class CheckpointError(ValueError):
    """The checkpoint folder is malformed: a file missing or unreadable, a required key absent or
    of the wrong type, a weight of the wrong shape. Loading it again fails the same way."""


class MissingCheckpointFileError(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs is not there."""


_REQUIRED = object()


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: str | None  # the checkpoint's torch dtype name, if it says
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise MissingCheckpointFileError(f"the model folder {model_dir} (model_dir) does not exist")
        if not path.is_file():
            raise MissingCheckpointFileError(f"no config.json in model folder {model_dir}")
        try:
            hf = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{path} does not read as JSON: {e}") from e
        if not isinstance(hf, dict):
            raise CheckpointError(f"{path} holds a JSON {type(hf).__name__}, not an object")
        config = cls.from_dict(hf)
        eos = tuple(dict.fromkeys(config.eos_token_ids + _checkpoint_eos_ids(Path(model_dir))))
        return replace(config, eos_token_ids=eos)

    @classmethod
    def from_dict(cls, hf: dict) -> "ModelConfig":
        family = _family(hf)
        _refuse_unsupported(hf)
        num_heads = _size(hf, "num_attention_heads")
        hidden = _size(hf, "hidden_size")
        num_kv_heads = _size(hf, "num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        head_dim = _size(hf, "head_dim", hidden // num_heads)
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            family=family,
            vocab_size=_size(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_size(hf, "intermediate_size"),
            num_layers=_size(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_number(hf, "rms_norm_eps", float, 1e-6),
            rope=_rope(hf),
            max_position_embeddings=_size(hf, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and never o bias; Llama/Qwen3 follow attention_bias.
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            dtype=hf.get("torch_dtype") or hf.get("dtype"),
            eos_token_ids=_as_ids(hf.get("eos_token_id")),
            bos_token_id=hf.get("bos_token_id"),
        )


def _number(values: dict, key: str, kind: type, default=_REQUIRED, where: str = "config.json"):
    """`values[key]` as `kind` (a missing or null key takes `default`), or a CheckpointError
    naming the key."""
    value = values.get(key)
    if value is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{where} has no {key!r}, which the model needs")
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (kind is int and value != int(value))):
        raise CheckpointError(f"{where}'s {key!r} is {value!r}; it must be {'an integer' if kind is int else 'a number'}")
    return kind(value)


def _size(values: dict, key: str, default=_REQUIRED) -> int:
    """A count or a dimension: a positive integer."""
    value = _number(values, key, int, default)
    if value < 1:
        raise CheckpointError(f"config.json's {key!r} is {value}; it must be at least 1")
    return value


def _family(hf: dict) -> str:
    archs = hf.get("architectures") or []
    if archs:
        unknown = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if unknown:
            raise UnsupportedModelError(
                f"unsupported architecture {unknown[0]!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        return SUPPORTED_ARCHITECTURES[archs[0]]
    model_type = hf.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported: {sorted(_MODEL_TYPES)}")
    return _MODEL_TYPES[model_type]


def _refuse_unsupported(hf: dict) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")
    for key in _MOE_KEYS:
        if hf.get(key):
            raise UnsupportedModelError(f"mixture of experts ({key}={hf[key]}) is not supported")
    # Mistral sets sliding_window directly; Qwen2/3 carry a value but gate it by use_sliding_window.
    window = hf.get("sliding_window")
    uses_window = hf.get("use_sliding_window", hf.get("model_type") == "mistral")
    if window is not None and uses_window and window < hf.get("max_position_embeddings", math.inf):
        raise UnsupportedModelError(f"sliding window attention (sliding_window={window}) is not supported")
    layer_types = hf.get("layer_types") or []
    odd = sorted({t for t in layer_types if t != "full_attention"})
    if odd:
        raise UnsupportedModelError(f"layer types {odd} are not supported; only full_attention")
    method = (hf.get("quantization_config") or {}).get("quant_method")
    if method is not None and method != OUR_QUANT_METHOD:
        raise UnsupportedModelError(f"checkpoints quantized with {method!r} are not supported; quantize the float "
                                    f"checkpoint with `python -m tools.quantize_checkpoint` instead")
    if int(hf.get("pretraining_tp", 1)) != 1:
        raise UnsupportedModelError(f"pretraining_tp={hf['pretraining_tp']} is not supported")


def _rope(hf: dict) -> RopeConfig:
    # transformers >= 5 writes rope_parameters; older checkpoints use rope_theta + rope_scaling.
    params, scaling = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise CheckpointError(f"config.json's {key!r} is {value!r}; it must be an object")
    where = "config.json's " + ("rope_parameters" if params else "rope_scaling")
    params = {**scaling, **params}
    theta = (_number(params, "rope_theta", float, where=where) if params.get("rope_theta") is not None
             else _number(hf, "rope_theta", float, 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=_number(params, "factor", float, where=where))
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=_number(params, "factor", float, where=where),
        low_freq_factor=_number(params, "low_freq_factor", float, 1.0, where),
        high_freq_factor=_number(params, "high_freq_factor", float, 4.0, where),
        original_max_position_embeddings=_number(params, "original_max_position_embeddings", int, 8192, where),
    )


def _checkpoint_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """The end-of-sequence ids a checkpoint names beyond config.json, as the gateway's tokenizer
    reads them (gateway/tokenizer.py): generation_config.json's `eos_token_id` (where chat models
    name their end of turn, e.g. Llama 3's <|eot_id|>) and the tokenizer's `eos_token`."""
    ids = list(_as_ids(_read_json(model_dir / "generation_config.json").get("eos_token_id"), "generation_config.json"))
    eos = _read_json(model_dir / "tokenizer_config.json").get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str):
        tokenizer = _read_json(model_dir / "tokenizer.json")
        added = {t.get("content"): t.get("id") for t in tokenizer.get("added_tokens") or [] if isinstance(t, dict)}
        vocab = (tokenizer.get("model") or {}).get("vocab")
        eos_id = added.get(eos, vocab.get(eos) if isinstance(vocab, dict) else None)
        if isinstance(eos_id, int):
            ids.append(eos_id)
    return tuple(ids)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _as_ids(value, where: str = "config.json") -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(f"{where}'s 'eos_token_id' is {value!r}; it must be a token id or a list of them")
    return tuple(values)
