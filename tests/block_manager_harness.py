"""A block manager driven the way the engine drives one, for tests: a small pool with a fixed block size,
and a request admitted as the engine admits it (prefix lookup, slots for all tokens, then cache)."""
from worker.block_manager import BlockManager

BS = 4  # block size used by the unit tests


def make(num_blocks=8, caching=True) -> BlockManager:
    return BlockManager(num_blocks, BS, enable_prefix_caching=caching)


def run_request(bm, request_id, token_ids, max_cached_tokens=None):
    """Admit a request the way the engine does: prefix lookup, slots for all tokens, then cache."""
    if max_cached_tokens is None:
        max_cached_tokens = len(token_ids)
    hit = bm.allocate_prefix(request_id, token_ids, max_cached_tokens)
    assert bm.allocate_slots(request_id, len(token_ids))
    bm.cache_blocks(request_id, token_ids, len(token_ids))
    bm.check_integrity()
    return hit
