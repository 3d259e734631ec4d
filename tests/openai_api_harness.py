"""The OpenAI HTTP API's test ground: a real gateway with two real workers and an HTTP port, the official
`openai` client on it and the in-process engine (module-scoped fixtures, which each test module binds as its
own), the engine's greedy outputs, and the gateway's request records."""
from __future__ import annotations

import json

import openai
import pytest

from bench.cluster_process import free_port
from cluster_harness import Cluster

MODEL = "llama"  # the served checkpoint's folder name


@pytest.fixture(scope="module")
def cluster(served_checkpoint):
    with Cluster(served_checkpoint, num_workers=2, sections={"gateway": {"http_port": free_port()}}) as c:
        yield c


@pytest.fixture(scope="module")
def base_url(cluster):
    return f"http://127.0.0.1:{cluster.http_port}"


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def engine(served_checkpoint):
    from worker.engine import Engine
    return Engine.from_model_dir(served_checkpoint, num_kv_blocks=256)


def greedy(engine, prompt_ids: list[int], max_tokens: int, **params):
    from worker.engine import SamplingParams
    [out] = engine.generate([prompt_ids], [SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)],
                            use_tqdm=False)
    return out


def request_records(cluster) -> list[dict]:
    records = []
    for line in cluster.logs("gateway").splitlines():
        if '"event":"request"' in line:
            records.append(json.loads(line[line.index("{"):]))
    return records
