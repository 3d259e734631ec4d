"""What model a process serves, as a short fingerprint both the gateway and a worker compute from
their own model folders: a worker whose fingerprint differs from the gateway's serves another
model (or another tokenizer) and is refused, whatever folder name it uses.

It hashes the files that decide what a token id means and what the model computes from it: the
model's and tokenizer's configs, the tokenizer itself, the chat template, and each safetensors
file's header (every tensor's name, dtype, shape and offsets) with the file's size and a sample
of its weight bytes (SAMPLES runs of SAMPLE_BYTES spread evenly over the data). A fine-tune of the
same architecture and tokenizer (a rolling update from one to the next, where a stream resumed on
the other worker would go on with other weights) changes nearly every weight, so the sample tells
it apart, while a many-gigabyte checkpoint is still fingerprinted in milliseconds. Stdlib only.
"""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path

FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "generation_config.json", "chat_template.jinja", "tokenizer.model")
MAX_HEADER_BYTES = 100 << 20  # a safetensors header past this is not one
SAMPLES = 16
SAMPLE_BYTES = 4096
SCHEME = "v2"  # how the fingerprint is computed: two processes of different schemes cannot compare theirs


def scheme_of(fingerprint: str) -> str:
    return fingerprint.partition("-")[0] if "-" in fingerprint else "v1"


def model_fingerprint(model_dir: str | Path) -> str:
    """SCHEME-16 hex digits; the same for folders holding the same model, whatever their paths."""
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
    return f"{SCHEME}-{h.hexdigest()[:16]}"


def _safetensors_header(path: Path) -> bytes:
    """The file's header, then the sample of its weight bytes."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return b""
        (length,) = struct.unpack("<Q", prefix)
        header = f.read(min(length, MAX_HEADER_BYTES))
        start, size = 8 + length, path.stat().st_size
        span = max(0, size - start - SAMPLE_BYTES)
        samples = []
        for i in range(SAMPLES):
            f.seek(start + span * i // (SAMPLES - 1))
            samples.append(f.read(SAMPLE_BYTES))
        return header + b"".join(samples)
