"""Creates (once) and locates the random-weight Llama checkpoints the benchmarks run on: "bench-small",
"tinyllama-shape" (TinyLlama-1.1B's shape, 4.4 GB in float32, for a weight stream that no cache
holds) and "overhead-probe" (hidden 64, 8 layers: almost no weights, so its step is the fixed
cost). Nothing is downloaded: each model is built from a config with a seeded init and saved with
save_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO_ROOT / ".cache" / "bench-small"  # .cache/ is git-ignored
SEED = 0

# The shape is part of the benchmark's definition: changing it changes every number.
BENCH_SMALL = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1376,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


TINYLLAMA_SHAPE = dict(
    hidden_size=2048,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    intermediate_size=5632,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
OVERHEAD_PROBE = dict(
    hidden_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
SHAPES = {"bench-small": BENCH_SMALL, "tinyllama-shape": TINYLLAMA_SHAPE, "overhead-probe": OVERHEAD_PROBE}


def _is_complete(model_dir: Path, shape: dict = BENCH_SMALL) -> bool:
    """A checkpoint counts as present only if its config matches the shape and the weights were written."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file() or not any(model_dir.glob("*.safetensors")):
        return False
    cfg = json.loads(cfg_path.read_text())
    return all(cfg.get(k) == v for k, v in shape.items())


def ensure_checkpoint(name: str) -> Path:
    """`.cache/<name>`, one of SHAPES, made first if missing."""
    return ensure_bench_small(REPO_ROOT / ".cache" / name, SHAPES[name])


def ensure_bench_small(model_dir: str | Path | None = None, shape: dict = BENCH_SMALL) -> Path:
    """Return the checkpoint folder, creating the seeded random float32 model there first if it is missing."""
    model_dir = Path(model_dir) if model_dir is not None else DEFAULT_DIR
    if _is_complete(model_dir, shape):
        return model_dir

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, dtype="float32")
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


if __name__ == "__main__":
    print(ensure_bench_small())
