"""Picks the checkpoint the serving benchmarks run on, and gives it a tokenizer the gateway accepts.

The gateway needs `tokenizer.json` beside the weights, so a random checkpoint alone cannot be
served. Preference: the project's default model (models/default) when it is complete; otherwise
"bench-small" (bench/checkpoints.py) seen through `.cache/bench-small-served/`, a folder of
symlinks to its files plus a synthetic byte-level BPE tokenizer whose vocabulary is exactly the
model's. Its tokens are printable ASCII pieces, so detokenizing costs what a real BPE costs and
never produces half characters the gateway would hold back.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench.checkpoints import DEFAULT_DIR as BENCH_SMALL_DIR, REPO_ROOT, ensure_bench_small

DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "default"
SERVED_BENCH_SMALL_DIR = REPO_ROOT / ".cache" / "bench-small-served"
TOKENIZER_SEED = 0
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: Llama's unk/bos/eos, as bench-small's config says


def is_servable(model_dir: Path) -> bool:
    return ((model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors"))
            and (model_dir / "tokenizer.json").is_file())


def resolve_model(choice: str = "auto") -> Path:
    """"auto": models/default when servable, else bench-small; "default" / "bench-small"; or a folder path."""
    if choice == "auto":
        return DEFAULT_MODEL_DIR if is_servable(DEFAULT_MODEL_DIR) else served_bench_small()
    if choice == "default":
        if not is_servable(DEFAULT_MODEL_DIR):
            raise FileNotFoundError(f"{DEFAULT_MODEL_DIR} lacks config, weights or tokenizer.json")
        return DEFAULT_MODEL_DIR
    if choice == "bench-small":
        return served_bench_small()
    path = Path(choice)
    if not is_servable(path):
        raise FileNotFoundError(f"{path} lacks config.json, *.safetensors or tokenizer.json")
    return path


def model_limits(model_dir: Path) -> tuple[int, int]:
    """(vocab_size, max_position_embeddings) from the checkpoint's config."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config["vocab_size"]), int(config.get("max_position_embeddings", 2048))


def served_bench_small() -> Path:
    source = ensure_bench_small(BENCH_SMALL_DIR)
    target = SERVED_BENCH_SMALL_DIR
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        link = target / path.name
        if not link.exists():
            link.symlink_to(path.resolve())
    if not (target / "tokenizer.json").is_file():
        vocab_size, _ = model_limits(source)
        write_synthetic_tokenizer(target, vocab_size)
    return target


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer and decoder use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_synthetic_tokenizer(model_dir: Path, vocab_size: int) -> Path:
    """A byte-level BPE with exactly vocab_size ids: specials, the 256 byte symbols, then 2- and 3-character
    printable-ASCII pieces with the merges that build them, in a seeded order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _byte_level_chars()
    vocab: dict[str, int] = {s: i for i, s in enumerate(SPECIALS)}
    for b in range(256):
        vocab[chars[b]] = len(vocab)
    ascii_syms = [chars[b] for b in range(32, 127)]  # space is "Ġ" in byte-level form
    rng = random.Random(TOKENIZER_SEED)
    pairs = [(a, b) for a in ascii_syms for b in ascii_syms]
    rng.shuffle(pairs)
    merges: list[tuple[str, str]] = []
    for a, b in pairs:
        if len(vocab) >= vocab_size:
            break
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    triples = [(a + b, c) for a, b in pairs for c in ascii_syms]
    rng.shuffle(triples)
    for ab, c in triples:
        if len(vocab) >= vocab_size:
            break
        if ab in vocab and ab + c not in vocab:
            vocab[ab + c] = len(vocab)
            merges.append((ab, c))
    if len(vocab) != vocab_size:
        raise ValueError(f"could not build {vocab_size} tokens (got {len(vocab)})")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=SPECIALS[0], bos_token=SPECIALS[1],
                                   eos_token=SPECIALS[2])
    fast.save_pretrained(str(model_dir))
    return model_dir


if __name__ == "__main__":
    print(resolve_model())
