"""Loading modes: sharded and on-demand placement give exactly the greedy tokens of full loading.

On the CPU, sharding over ("cpu", "cpu", ...) runs every stage boundary and move, and on-demand
loading copies each layer into its device slot, so these tests drive the same code a GPU runs;
only the CUDA specifics (pinned memory, the side stream, events) go untested here.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch

from conftest import make_checkpoint
from shared.config import ConfigError, add_config_flags, config_from_args, load_config
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.model.placement import (OnDemandLayers, ShardedLayers, layer_tensors, plan_weights,
                                    split_layers)
from worker.model.quantization import QuantizedLinear
from worker.model.weights import load_model
from worker.service import engine_config

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Small chunks and a second wave of requests: steps mix decodes with prompt chunks.
SMALL = dict(num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=48, max_prefill_chunk_tokens=16)
FIRST_WAVE = {"a": [5, 6, 7], "b": list(range(3, 40)), "c": [9] * 20}
SECOND_WAVE = {"d": [11, 12], "e": list(range(100, 130))}
ROOT = Path(__file__).resolve().parent.parent
NUM_LAYERS = {"llama": 4, "qwen3": 3}  # qwen3: tied embeddings, q/k norms, a layer count odd to 2 slots


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading_modes")
    return {arch: make_checkpoint(root / arch, arch, num_hidden_layers=n) for arch, n in NUM_LAYERS.items()}


def run_workload(engine: Engine) -> tuple[dict[str, list[int]], int]:
    """Greedy tokens per request, and the number of forwards, for two overlapping waves."""
    steps = []
    execute = engine.runner.execute

    def recording_execute(seqs):
        steps.append([len(s.new_token_ids) for s in seqs])
        return execute(seqs)

    engine.runner.execute = recording_execute
    for request_id, prompt in FIRST_WAVE.items():
        engine.add_request(request_id, prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        if len(steps) == 2:
            for request_id, prompt in SECOND_WAVE.items():
                engine.add_request(request_id, prompt, GREEDY)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.final.token_ids
        engine.check_integrity()
    assert any(1 in step and max(step) > 1 for step in steps), "some step should mix decodes and prompt chunks"
    assert set(tokens) == set(FIRST_WAVE) | set(SECOND_WAVE)
    return tokens, len(steps)


_REFERENCE: dict[tuple, dict[str, list[int]]] = {}


def full_tokens(model_dir, **overrides) -> dict[str, list[int]]:
    key = (str(model_dir), tuple(sorted(overrides.items())))
    if key not in _REFERENCE:
        engine = Engine.from_model_dir(model_dir, **SMALL, **overrides)
        assert engine.model.placement is None
        _force_dequant(engine)
        _REFERENCE[key] = run_workload(engine)[0]
    return _REFERENCE[key]


def _force_dequant(engine: Engine) -> None:
    """Quantized layers choose their compute path by timing; pin one so modes compare exactly."""
    modules = list(engine.model.modules())
    if isinstance(engine.model.placement, OnDemandLayers):
        modules += [m for slot in engine.model.placement.slots for m in slot.module.modules()]
    for m in modules:
        if isinstance(m, QuantizedLinear):
            m.path = m.small_path = "dequant"


# ---- sharded -----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, num_devices, stages", [
    ("llama", 2, [[0, 1], [2, 3]]),
    ("llama", 3, [[0, 1], [2], [3]]),
    ("llama", 4, [[0], [1], [2], [3]]),
    ("qwen3", 2, [[0, 1], [2]]),
])
def test_sharded_over_cpu_devices_matches_full(model_dirs, arch, num_devices, stages):
    engine = Engine.from_model_dir(model_dirs[arch], **SMALL, load_mode="sharded", devices=["cpu"] * num_devices)
    placement = engine.model.placement
    assert isinstance(placement, ShardedLayers)
    assert [list(stage.layer_indices) for stage in placement.stages] == stages
    assert engine.config.devices == ("cpu",) * num_devices
    # Each layer's KV beside its layer; one pool per layer.
    assert len(engine.kv_caches) == NUM_LAYERS[arch]
    assert [k.device for k, _ in engine.kv_caches] == engine.model.layer_devices
    tokens, num_forwards = run_workload(engine)
    assert tokens == full_tokens(model_dirs[arch])
    assert placement.num_boundary_moves == num_forwards * num_devices  # every stage entered every forward


@pytest.mark.parametrize("stage_of_layer", [[0, 1, 1, 1], [0, 0, 0, 1]])
def test_uneven_stage_splits_match_full(model_dirs, stage_of_layer):
    engine = Engine.from_model_dir(model_dirs["llama"], **SMALL)
    plan = plan_weights("sharded", "cpu", ("cpu", "cpu"), 4, stage_of_layer=stage_of_layer)
    engine.model.placement = ShardedLayers(plan.stage_of_layer, plan.layer_devices)
    engine.runner.fast_path = None  # chosen for the full layout, which the placement replaces
    assert run_workload(engine)[0] == full_tokens(model_dirs["llama"])


def test_layers_split_into_contiguous_even_stages():
    assert split_layers(4, 2) == [0, 0, 1, 1]
    assert split_layers(5, 2) == [0, 0, 0, 1, 1]  # earlier stages take the remainder
    assert split_layers(7, 3) == [0, 0, 0, 1, 1, 2, 2]
    assert split_layers(3, 3) == [0, 1, 2]
    plan = plan_weights("sharded", "cpu", ("cpu", "cpu"), 3)
    assert plan.embed_device == plan.head_device == torch.device("cpu") and plan.stage_of_layer == (0, 0, 1)
    with pytest.raises(ValueError, match="cannot split 2 decoder layers into 3"):
        split_layers(2, 3)
    with pytest.raises(ValueError, match="stage_of_layer"):
        plan_weights("sharded", "cpu", ("cpu", "cpu"), 3, stage_of_layer=[1, 0, 0])


# ---- on demand ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_on_demand_matches_full_with_at_most_two_layers_resident(model_dirs, arch, caplog):
    with caplog.at_level(logging.INFO, logger="worker.engine_builder"):
        engine = Engine.from_model_dir(model_dirs[arch], **SMALL, load_mode="on_demand")
    assert engine.load_seconds > 0
    assert any("load_mode on_demand" in r.getMessage() for r in caplog.records)
    placement = engine.model.placement
    assert isinstance(placement, OnDemandLayers) and len(placement.slots) == 2
    host_layers = engine.model.layers
    host_ptrs = {t.data_ptr() for layer in host_layers for _, t in layer_tensors(layer)}
    assert not host_ptrs & {t.data_ptr() for slot in placement.slots for t in slot.tensors}, "slots alias host weights"
    for layer in host_layers:  # only slots compute: a host layer that runs is a bug
        layer.forward = lambda *_: pytest.fail("a host-resident layer ran")
    copies = []
    copy_layer = placement.copy_layer

    def recording_copy(i, slot):
        copy_layer(i, slot)
        copies.append(i)
        assert len(placement.resident_layers()) <= 2

    placement.copy_layer = recording_copy
    tokens, num_forwards = run_workload(engine)
    assert tokens == full_tokens(model_dirs[arch])
    num_layers = NUM_LAYERS[arch]
    # Layer 0 once, then each forward copies layers 1.. and prefetches the next forward's layer 0.
    assert len(copies) == placement.num_layer_loads == 1 + num_layers * num_forwards
    assert copies[:2 * num_layers + 1] == list(range(num_layers)) * 2 + [0]
    # What the slots hold is exactly their layers' weights, and the host copies are untouched.
    full = load_model(model_dirs[arch])
    for slot in placement.slots:
        for (name, held), (_, reference) in zip(layer_tensors(slot.module), layer_tensors(full.layers[slot.layer_index])):
            assert torch.equal(held, reference), name
    for layer, reference in zip(host_layers, full.layers):
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(layer_tensors(layer), layer_tensors(reference)))


def test_hooks_on_a_host_layer_fire_when_a_slot_runs_it(model_dirs):
    """Calibration records activations with forward hooks on the model's own modules."""
    seen = {}
    for name, mode in [("full", {}), ("on_demand", dict(load_mode="on_demand"))]:
        engine = Engine.from_model_dir(model_dirs["llama"], **SMALL, **mode)
        engine.runner.fast_path = None  # as when calibrating: the modules run, which hooks observe
        inputs = seen[name] = []
        engine.model.layers[2].mlp.down_proj.register_forward_hook(lambda m, args, out: inputs.append(args[0].clone()))
        engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(seen["on_demand"]) == len(seen["full"]) == 3
    # Close, not bitwise: a resident layer may read its weight back from packed panels.
    for a, b in zip(seen["on_demand"], seen["full"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_on_demand_with_a_slot_per_layer_copies_each_layer_once(model_dirs):
    engine = Engine.from_model_dir(model_dirs["qwen3"], **SMALL)
    engine.model.placement = OnDemandLayers(engine.model.layers, torch.device("cpu"), num_slots=8)
    engine.runner.fast_path = None  # chosen for the full layout, which the placement replaces
    assert len(engine.model.placement.slots) == 3  # never more slots than layers
    assert run_workload(engine)[0] == full_tokens(model_dirs["qwen3"])
    assert engine.model.placement.num_layer_loads == 3
    assert sorted(engine.model.placement.resident_layers()) == [0, 1, 2]


# ---- quantization composes with every mode -------------------------------------------------------
_NO_CALIBRATION = ({"quantization_calibration": "none"}
                   if "quantization_calibration" in EngineConfig.__dataclass_fields__ else {})


@pytest.mark.parametrize("mode", [dict(load_mode="sharded", devices=("cpu", "cpu")), dict(load_mode="on_demand")],
                         ids=["sharded", "on_demand"])
def test_int8_quantization_composes_with_each_mode(model_dirs, mode):
    quantized = dict(quantization="int8", **_NO_CALIBRATION)
    engine = Engine.from_model_dir(model_dirs["llama"], **SMALL, **quantized, **mode)
    if mode["load_mode"] == "on_demand":
        # The slots were rebuilt from the quantized layers: they hold INT8, not the float weights.
        slot_module = engine.model.placement.slots[0].module
        assert isinstance(slot_module.self_attn.qkv_proj, QuantizedLinear)
        assert isinstance(slot_module.mlp.down_proj, QuantizedLinear)
        assert slot_module.self_attn.qkv_proj.qweight.dtype == torch.int8
    else:
        assert all(isinstance(layer.mlp.gate_up_proj, QuantizedLinear) for layer in engine.model.layers)
    _force_dequant(engine)
    assert run_workload(engine)[0] == full_tokens(model_dirs["llama"], **quantized)


# ---- configuration -----------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, words", [
    (dict(load_mode="lazy"), "load_mode must be one of"),
    (dict(load_mode="sharded"), "at least 2 devices"),
    (dict(load_mode="sharded", devices=("cpu",)), "at least 2 devices"),
    (dict(load_mode="full", devices=("cpu", "cpu")), "only for load_mode 'sharded'"),
    (dict(load_mode="on_demand", devices=("cpu", "cpu")), "only for load_mode 'sharded'"),
    (dict(load_mode="sharded", devices=("cpu", "cdua")), r"devices\[1\] = 'cdua' is not a device"),
    (dict(load_mode="sharded", devices=("cpu", "cuda:0")), "must all be of one type"),
    (dict(load_mode="sharded", devices=("cpu", "cpu"), device="cuda"), "contradicts"),
])
def test_bad_load_configs_are_refused_by_name(overrides, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(**overrides)


def test_more_stages_than_layers_is_refused_before_loading(model_dirs, monkeypatch):
    monkeypatch.setattr("worker.engine_builder.load_model", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ValueError, match="over 5 devices needs at least as many decoder layers, but the model has 4"):
        Engine.from_model_dir(model_dirs["llama"], load_mode="sharded", devices=["cpu"] * 5)
    with pytest.raises(ValueError, match="at least 2 layer slots"):
        OnDemandLayers(torch.nn.ModuleList(), torch.device("cpu"), num_slots=1)


def _parse_flags(argv):
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(argv))


def test_load_mode_flags_reach_the_engine_config():
    config = _parse_flags(["--worker.load_mode", "on_demand"])
    assert config.worker.load_mode == "on_demand" and config.worker.devices == ()
    assert engine_config(config).load_mode == "on_demand"
    config = _parse_flags(["--config", str(ROOT / "configs" / "default.toml"), "--worker.load-mode", "sharded",
                           "--worker.devices", '["cpu", "cpu"]'])
    built = engine_config(config)
    assert (built.load_mode, built.devices) == ("sharded", ("cpu", "cpu"))
    assert load_config(None).worker.load_mode == "full"
    for overrides, words in [({"worker.load_mode": "lazy"}, "worker.load_mode"),
                             ({"worker.load_mode": "sharded", "worker.devices": ["cpu"]}, "worker.devices"),
                             ({"worker.devices": ["cpu", "cpu"]}, "empty unless load_mode is sharded")]:
        with pytest.raises(ConfigError, match=words):
            load_config(None, overrides)
