"""A cluster serving a quantized checkpoint with on-demand loading: the worker settings
travel from the config file to the engine, and the stream matches the in-process engine."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster_harness import Cluster, generate
from gateway.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(300)
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "default"


def test_cluster_serves_a_quantized_checkpoint_on_demand(tmp_path):
    from tools.quantize_checkpoint import main
    from worker.engine import Engine, SamplingParams
    folder = tmp_path / "default-int8"
    # The trained default model, not a random one: its greedy choices are not near-ties, so the
    # worker and this process agree even where they timed different INT8 compute paths.
    main([str(DEFAULT_MODEL), str(folder), "--quantization", "int8"])
    tokenizer = Tokenizer(folder)
    texts = ["The json module", "Return the number of items", "A list is"]
    engine = Engine.from_model_dir(folder, num_kv_blocks=128)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in engine.generate([tokenizer.encode(t) for t in texts], params, use_tqdm=False)]
    with Cluster(folder, num_workers=1, sections={"worker": {"load_mode": "on_demand"}}) as cluster:
        for text, want in zip(texts, expected):
            ids, _, last = generate(cluster.stub, prompt=text, sampling=dict(max_tokens=16, temperature=0.0,
                                                                              ignore_eos=True))
            assert ids == want and last.usage.completion_tokens == 16
