"""A worker's KV pool smaller than the model's context, on a real cluster: a request whose prompt +
max_tokens no worker's whole pool can hold is refused INVALID_ARGUMENT at once, naming the pool
(it would otherwise wait in the queue for a worker that can never take it, or fail on one that
refuses it); a request that sets no max_tokens is fitted into the pool; the pool ends all free."""
from __future__ import annotations

import time

import grpc
import pytest

from cluster_harness import Cluster, generate, wait_all_free

pytestmark = pytest.mark.timeout(180)
POOL_BLOCKS = 8  # 128 tokens of 16 on the one worker, against a context of thousands


def test_a_request_no_pool_can_hold_is_refused_at_once_and_a_default_max_tokens_fits_the_pool(served_checkpoint):
    with Cluster(served_checkpoint, num_workers=1, sections={"worker": {"num_kv_blocks": POOL_BLOCKS}}) as cluster:
        for fields in (dict(prompt_token_ids=[5] * 10, sampling=dict(max_tokens=200, ignore_eos=True)),
                       dict(prompt_token_ids=[5] * 200)):  # the prompt alone: no default can fit it
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                generate(cluster.stub, timeout=60, **fields)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert "KV pool holds (128 tokens" in e.value.details() and "num_kv_blocks" in e.value.details()
            assert time.monotonic() - started < 10  # refused, not left to its deadline
        ids, _, last = generate(cluster.stub, prompt_token_ids=[5] * 100, sampling=dict(ignore_eos=True))
        assert len(ids) == 128 - 100  # the default max_tokens, fitted to the pool
        wait_all_free(cluster)
