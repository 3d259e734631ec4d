"""Activation-aware calibration and quantized checkpoints: the scale search helps where
activations have salient channels, results are saved beside the checkpoint and reused, and
a quantized checkpoint round-trips through save and load."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_checkpoint
from shared.engine_config import ConfigError
from tokenizer_fixture import make_tokenizer
from worker.engine import Engine, SamplingParams
from worker.model.calibration import ActivationStats, CalibrationSettings, search_input_scale
from worker.model.quantization import QuantizedLinear
from worker.model.quantized_weight import dequantize, quantize
from worker.model.quantize_model import QuantizationRule
from worker.scoring import window_logprobs

SALIENT = [5, 17, 40]


def _rows(generator: torch.Generator, n: int, k: int) -> torch.Tensor:
    x = torch.randn(n, k, generator=generator)
    x[:, SALIENT] *= 30  # a few channels carry most of the activation, as in real LLMs
    return x


def _relative_error(x: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor) -> float:
    reference = x @ weight.t()
    return ((x @ approx.t() - reference).pow(2).mean() / reference.pow(2).mean()).item()


@pytest.mark.parametrize("bits", [8, 4])
def test_scale_search_cuts_output_error_on_unseen_rows(bits):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=generator)
    stats = ActivationStats(torch.zeros(256, dtype=torch.float64))
    for _ in range(4):
        stats.add(_rows(generator, 200, 256), max_rows=512, generator=generator)
    input_scale, alpha, plain, chosen = search_input_scale(weight, stats, bits, 128, False, grid=11)
    assert 0 < alpha <= 1 and chosen < plain
    s = 1 / input_scale
    assert s[SALIENT].min() > s.median()  # the salient channels were scaled up before rounding
    held_out = _rows(generator, 500, 256)
    error_plain = _relative_error(held_out, weight, dequantize(quantize(weight, bits, 128)))
    error_scaled = _relative_error(held_out, weight, dequantize(quantize(weight * s, bits, 128)) / s)
    assert error_scaled < 0.5 * error_plain


def test_activation_stats_keep_exact_means_and_a_bounded_sample():
    generator = torch.Generator().manual_seed(1)
    stats = ActivationStats(torch.zeros(8, dtype=torch.float64))
    batches = [torch.randn(n, 8, generator=generator) for n in (30, 50, 70)]
    for batch in batches:
        stats.add(batch, max_rows=64, generator=generator)
    everything = torch.cat(batches)
    torch.testing.assert_close(stats.mean_abs.float(), everything.abs().mean(dim=0))
    assert stats.num_rows == 150 and stats.rows.shape == (64, 8)
    # Every kept row is one of the rows seen, and the sample reaches past the first batch.
    matches = (stats.rows[:, None, :] == everything[None, :, :]).all(-1)
    assert matches.any(1).all()
    assert matches.float().argmax(1).max() >= 30


def test_rules_by_type_and_by_size():
    rule = QuantizationRule.parse("params>=10000:int8, *:int4", group_size=32)
    assert rule.bits_for("layers.0.mlp.down_proj", torch.empty(100, 128)) == 8
    assert rule.bits_for("layers.0.self_attn.o_proj", torch.empty(64, 64)) == 4
    mixed = QuantizationRule.preset("mixed")
    assert mixed.bits_for("layers.1.self_attn.qkv_proj", torch.empty(192, 128)) == 8
    assert mixed.bits_for("layers.1.mlp.gate_up_proj", torch.empty(512, 128)) == 4
    assert QuantizationRule.parse("attention:none,*:int8").bits_for("x.o_proj", torch.empty(4, 4)) is None
    assert mixed.text == "attention:int8,mlp:int4;g128"
    for bad, message in [("attention=int8", "selector:bits"), ("attention:int3", "selector:bits"),
                         ("conv:int8", "selector")]:
        with pytest.raises(ValueError, match=message):
            QuantizationRule.parse(bad)
    with pytest.raises(ValueError, match="calibration source"):
        CalibrationSettings(source="/no/such/file.txt")


@pytest.fixture
def outlier_checkpoint(tmp_path):
    """A tiny model rewritten, without changing what it computes, to have salient channels:
    the norms feeding each projection scale a few channels up 30x and the projections'
    columns for them down 30x (the outlier pattern of real LLMs)."""
    path = make_checkpoint(tmp_path / "outliers", "llama", seed=3, vocab_size=320, hidden_size=128,
                           intermediate_size=256)
    make_tokenizer(path, vocab_size=320)
    weights = load_file(str(path / "model.safetensors"))
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        for norm, projections in [("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                  ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))]:
            weights[prefix + norm + ".weight"][SALIENT] *= 30
            for projection in projections:
                weights[prefix + projection + ".weight"][:, SALIENT] /= 30
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _logprob_error(engine: Engine, reference: list[torch.Tensor], texts: list[list[int]]) -> float:
    return sum((window_logprobs(engine.model, t) - r).abs().mean().item() for t, r in zip(texts, reference))


def test_self_calibration_beats_plain_rounding_and_is_saved_and_reused(outlier_checkpoint, monkeypatch):
    common = dict(num_kv_blocks=128, quantization="int4", quantization_group_size=64)
    full = Engine.from_model_dir(outlier_checkpoint, num_kv_blocks=128)
    texts = [list(range(3 + i, 300, 7 + i)) for i in range(3)]
    reference = [window_logprobs(full.model, t) for t in texts]
    plain = Engine.from_model_dir(outlier_checkpoint, quantization_calibration="none", **common)
    assert plain.calibration is None
    calibrated = Engine.from_model_dir(outlier_checkpoint, **common)
    info = calibrated.calibration.info
    assert info["num_sequences"] == 8 * 4 and info["num_tokens"] > 8 * 4 * 10  # the model's own samples
    layer = calibrated.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, QuantizedLinear) and layer.input_scale is not None
    assert (1 / layer.input_scale)[SALIENT].min() > (1 / layer.input_scale).median()
    error_plain, error_calibrated = _logprob_error(plain, reference, texts), _logprob_error(calibrated, reference,
                                                                                           texts)
    print(f"\nlog-prob error vs float: plain {error_plain:.4f}, calibrated {error_calibrated:.4f}")
    assert error_calibrated < 0.7 * error_plain, (error_plain, error_calibrated)  # measured 0.31 -> 0.08

    saved = list((outlier_checkpoint / "calibration").glob("awq-*.safetensors"))
    assert len(saved) == 1
    # A second start reuses the file: calibrating again would fail here.
    monkeypatch.setattr("worker.calibrate.calibrate", lambda *a, **k: pytest.fail("calibrated again"))
    again = Engine.from_model_dir(outlier_checkpoint, **common)
    assert again.calibration.alphas == calibrated.calibration.alphas
    assert _logprob_error(again, reference, texts) == pytest.approx(error_calibrated, rel=1e-5)


def test_calibration_from_a_text_file_and_a_read_only_folder(outlier_checkpoint, tmp_path, monkeypatch):
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. Paged attention keeps blocks. " * 40)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (outlier_checkpoint / "calibration").write_text("a file where the folder would go: saving there fails")
    engine = Engine.from_model_dir(outlier_checkpoint, num_kv_blocks=64, quantization="int8",
                                   quantization_calibration=str(text))
    info = engine.calibration.info
    assert info["settings"]["source"] == str(text) and info["num_sequences"] >= 2
    assert list((tmp_path / "cache" / "inference_cluster" / "calibration").glob("awq-*.safetensors"))


def test_quantized_checkpoint_round_trips(outlier_checkpoint, tmp_path):
    from tools.quantize_checkpoint import main
    out = tmp_path / "int4"
    main([str(outlier_checkpoint), str(out), "--quantization", "mixed", "--rule", "params>=30000:int8,*:int4",
          "--group-size", "64"])
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "inference-cluster-woq" and config["rule"].startswith("params>=30000:int8")
    assert {layer["bits"] for layer in config["layers"].values()} == {8, 4}
    assert (out / "tokenizer.json").is_file()
    assert (out / "model.safetensors").stat().st_size < 0.6 * (outlier_checkpoint / "model.safetensors").stat().st_size

    in_memory = Engine.from_model_dir(outlier_checkpoint, num_kv_blocks=64, quantization="mixed",
                                      quantization_rule="params>=30000:int8,*:int4", quantization_group_size=64)
    loaded = Engine.from_model_dir(out, num_kv_blocks=64)
    assert loaded.quantization_report is None  # nothing left to do at start
    for name, module in in_memory.model.named_modules():
        if isinstance(module, QuantizedLinear):
            twin = loaded.model.get_submodule(name)
            assert isinstance(twin, QuantizedLinear) and twin.bits == module.bits
            assert torch.equal(twin.qweight, module.qweight) and torch.equal(twin.input_scale, module.input_scale)
    prompts = [list(range(3, 40)), list(range(50, 60)), [7] * 5]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in in_memory.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in loaded.generate(prompts, params, use_tqdm=False)] == expected

    # A ConfigError naming the key: its worker exits EXIT_DO_NOT_RESTART rather than restart into it again.
    with pytest.raises(ConfigError, match=f"quantization 'int8': {out} is already quantized"):
        Engine.from_model_dir(out, num_kv_blocks=64, quantization="int8")
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["layers.1.mlp.down_proj.scales"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors.*down_proj.scales"):
        Engine.from_model_dir(broken, num_kv_blocks=64)


def test_foreign_quantized_checkpoints_are_refused(outlier_checkpoint, tmp_path):
    foreign = tmp_path / "gptq"
    shutil.copytree(outlier_checkpoint, foreign)
    config = json.loads((foreign / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (foreign / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized with 'gptq' are not supported"):
        Engine.from_model_dir(foreign, num_kv_blocks=16)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # an untied head, and one tied to the embedding
def test_head_quantization_is_opt_in_and_round_trips(checkpoints, tmp_path, arch):
    from tools.quantize_checkpoint import main
    source = checkpoints[arch]
    float_engine = Engine.from_model_dir(source, num_kv_blocks=64)
    assert not isinstance(Engine.from_model_dir(source, num_kv_blocks=64, quantization="int8",
                                                quantization_calibration="none").model.lm_head, QuantizedLinear)
    rule = dict(quantization="mixed", quantization_rule="*:int8,head:int8", quantization_calibration="none")
    engine = Engine.from_model_dir(source, num_kv_blocks=64, **rule)
    head = engine.model.lm_head
    assert isinstance(head, QuantizedLinear) and head.bits == 8
    assert engine.quantization_report.num_quantized["head:int8"] == 1
    # The embedding keeps its float weights, tied or not.
    assert torch.equal(engine.model.embed_tokens.weight, float_engine.model.embed_tokens.weight)
    tokens = list(range(3, 120, 3))
    drift = (window_logprobs(engine.model, tokens) - window_logprobs(float_engine.model, tokens)).abs().mean()
    assert drift < 0.01, drift

    out = tmp_path / f"{arch}-int8-head"
    main([str(source), str(out), "--quantization", "mixed", "--rule", "*:int8,head:int8", "--calibration", "none"])
    loaded = Engine.from_model_dir(out, num_kv_blocks=64)
    assert isinstance(loaded.model.lm_head, QuantizedLinear)
    assert torch.equal(loaded.model.lm_head.qweight, head.qweight)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 30)), [9] * 6]
    assert ([o.token_ids for o in loaded.generate(prompts, params, use_tqdm=False)]
            == [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)])


def test_a_torn_or_foreign_calibration_file_is_calibrated_again_and_overwritten(tmp_path, monkeypatch, caplog):
    """A file that does not read as a calibration is no reason to stop: every start would stop again."""
    from types import SimpleNamespace

    from worker.calibrate import load_or_calibrate
    from worker.model.calibration import Calibration, calibration_file_name
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"weights")
    rule, settings = QuantizationRule.preset("int8"), CalibrationSettings()
    fresh = Calibration({"x": torch.ones(4)}, {"x": 0.5}, {"x": (2.0, 1.0)},
                        dict(num_sequences=1, num_tokens=9, seconds=0.1))
    monkeypatch.setattr("worker.calibrate.calibrate", lambda *a: fresh)
    path = model_dir / "calibration" / calibration_file_name(model_dir, rule, settings)
    fresh.save(path)
    torn = path.read_bytes()[:100]  # an interrupted copy
    save_file({"y": torch.ones(2)}, str(tmp_path / "foreign.safetensors"), metadata={"version": "1"})
    for unreadable in (torn, (tmp_path / "foreign.safetensors").read_bytes()):
        path.write_bytes(unreadable)
        caplog.clear()
        calibration, saved = load_or_calibrate(SimpleNamespace(model_dir=model_dir), rule, settings)
        assert calibration is fresh and saved == path
        assert f"ignoring unreadable calibration {path}" in caplog.text
        assert Calibration.load(path).alphas == {"x": 0.5}  # overwritten with the new one


def test_a_calibration_text_file_it_cannot_use_is_a_config_error_naming_it(outlier_checkpoint, tmp_path):
    empty, binary = tmp_path / "empty.txt", tmp_path / "binary.txt"
    empty.write_text("\n")
    binary.write_bytes(bytes(range(128, 256)) * 8)
    for path, words in [(empty, "holds fewer than 2 tokens"), (binary, "is not UTF-8 text")]:
        with pytest.raises(ConfigError, match=f"quantization_calibration {path} {words}"):
            Engine.from_model_dir(outlier_checkpoint, num_kv_blocks=64, quantization="int8",
                                  quantization_calibration=str(path))


def test_quantize_checkpoint_answers_bad_input_with_one_line_and_exit_2(outlier_checkpoint, tmp_path, capsys,
                                                                        monkeypatch):
    from tools import quantize_checkpoint
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(128, 256)) * 8)
    source, out, nowhere = str(outlier_checkpoint), str(tmp_path / "out"), tmp_path / "nowhere"

    def refusal(args: list[str]) -> str:
        with pytest.raises(SystemExit) as exit_:
            quantize_checkpoint.main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("usage: ") and "Traceback" not in err, err
        return err.strip().splitlines()[-1]

    assert re.search(f"error: the model folder {nowhere} .*does not exist", refusal([str(nowhere), out]))
    assert re.search("error: --rule .* with --quantization mixed", refusal([source, out, "--rule", "*:int8"]))
    assert f"error: quantization_calibration {binary} is not UTF-8 text" in refusal(
        [source, out, "--calibration", str(binary)])
    monkeypatch.setattr(quantize_checkpoint, "Engine", None)  # refused before anything loads
    assert f"error: out_dir {source} is the source checkpoint" in refusal([source, source])
