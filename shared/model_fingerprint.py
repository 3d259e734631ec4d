"""What model a process serves, as a short fingerprint both the gateway and a worker compute from
their own model folders: a worker whose fingerprint differs from the gateway's serves another
model (or another tokenizer) and is refused, whatever folder name it uses.

It hashes the files that decide what a token id means and what the model computes from it: the
model's and tokenizer's configs, the tokenizer itself, the chat template, and each safetensors
file's header (every tensor's name, dtype, shape and offsets) with the file's size. The weights'
bytes are not read, so a many-gigabyte checkpoint is fingerprinted in milliseconds; two folders
with the same tensors of the same sizes and different values agree, which no honest deployment
produces. Stdlib only.
"""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path

FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "generation_config.json", "chat_template.jinja", "tokenizer.model")
MAX_HEADER_BYTES = 100 << 20  # a safetensors header past this is not one


def model_fingerprint(model_dir: str | Path) -> str:
    """16 hex digits; the same for folders holding the same model, whatever their paths."""
    folder = Path(model_dir)
    h = hashlib.sha256()
    for name in FILES:
        path = folder / name
        if path.is_file():
            h.update(f"{name}\0".encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
    for path in sorted(folder.glob("*.safetensors")):
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        h.update(_safetensors_header(path))
    return h.hexdigest()[:16]


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return b""
        (length,) = struct.unpack("<Q", prefix)
        return f.read(min(length, MAX_HEADER_BYTES))
