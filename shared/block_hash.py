"""The prefix cache's block hash, defined once for every process: a worker's block manager keys
its cached blocks by it, and the gateway can compute the same hashes from a prompt's token ids
(stdlib only, so the gateway needs no worker code and no torch)."""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

# Parent hash of a request's first block, so every chain starts from the same root.
ROOT_HASH = b""


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained content hash of one full block; stable across processes and machines (unlike hash())."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash)
    # Fixed little-endian width, so the bytes do not depend on the host.
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def chain_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes of every full block of `token_ids`, first block first."""
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
