"""Calibrate a float model for quantization, or reuse the result saved last time.

Owns the order of calibration at engine level: make the calibration set (a plain float engine's
own sampled continuations of a handful of prompts, or windows of a text file; the builder makes
that engine over the model and drops it afterwards), run every sequence through the float model teacher-forced while hooks record the
projections' inputs, search each projection's input scales, and keep the result beside the
checkpoint. The pieces live in worker/model/calibration.py.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Protocol, Sequence

from shared.sampling_params import SamplingParams
from worker.model.calibration import (Calibration, CalibrationSettings, calibration_file_name, calibration_prompts,
                                      describe_sequences, find_calibration, now_info, record_activations,
                                      save_calibration, search_model, text_file_windows)
from shared.engine_config import EngineConfig
from shared.quantization_rule import QuantizationRule
from worker.model.config import ModelConfig
from worker.scoring import window_nll

log = logging.getLogger(__name__)


class FloatEngine(Protocol):
    """What calibration needs of the engine the builder makes over the still-float model."""
    model: object  # the Transformer whose projections are recorded
    model_config: ModelConfig
    model_dir: Path
    max_model_len: int
    config: EngineConfig

    def generate(self, prompts: Sequence[Sequence[int]], params, use_tqdm: bool = True) -> list: ...


def calibration_sequences(engine: FloatEngine, settings: CalibrationSettings) -> list[list[int]]:
    config = engine.model_config
    if settings.source != "self":
        return text_file_windows(engine.model_dir, settings, window=min(engine.max_model_len, 256))
    prompts = calibration_prompts(engine.model_dir, settings, config.vocab_size, config.bos_token_id)
    jobs, params = [], []
    for i, prompt in enumerate(prompts):
        max_tokens = min(settings.max_new_tokens, engine.max_model_len - len(prompt))
        for sample in range(settings.samples_per_prompt):
            jobs.append(prompt)
            # Sampled, not greedy: several different continuations of each prompt, as the seeds do.
            params.append(SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95,
                                         seed=settings.seed * 1_000_003 + i * 1009 + sample))
    outputs = engine.generate(jobs, params, use_tqdm=False)
    return [list(prompt) + list(out.token_ids) for prompt, out in zip(jobs, outputs)]


def calibrate(engine: FloatEngine, rule: QuantizationRule, settings: CalibrationSettings) -> Calibration:
    """Calibrate the engine's (float) model for `rule`."""
    started = time.perf_counter()
    sequences = calibration_sequences(engine, settings)
    with record_activations(engine.model, settings.max_rows, settings.seed) as stats:
        for sequence in sequences:
            window_nll(engine.model, sequence, block_size=engine.config.block_size)
    calibration = search_model(engine.model, stats, rule, settings.grid)
    calibration.info = dict(rule=rule.text, settings=asdict(settings), **describe_sequences(sequences),
                            **now_info(started))
    return calibration


def load_or_calibrate(engine: FloatEngine, rule: QuantizationRule, settings: CalibrationSettings
                      ) -> tuple[Calibration, Path | None]:
    """The saved calibration for this checkpoint, rule and settings, else a fresh one (saved).
    Returns it and the file it came from or went to (None if it could not be saved)."""
    name = calibration_file_name(engine.model_dir, rule, settings)
    found = find_calibration(engine.model_dir, name)
    if found is not None:
        try:
            calibration = Calibration.load(found)
            log.info("reusing calibration %s: %s", found, calibration.summary())
            return calibration, found
        except (ValueError, OSError) as e:  # torn or foreign: calibrate again and overwrite it
            log.warning("ignoring unreadable calibration %s (%s)", found, e)
    calibration = calibrate(engine, rule, settings)
    try:
        path = save_calibration(calibration, engine.model_dir, name)
    except OSError as e:
        log.warning("calibration not saved: %s", e)
        path = None
    log.info("calibrated %s on %d sequences (%d tokens) in %.1f s: %s; saved to %s", rule.text,
             calibration.info["num_sequences"], calibration.info["num_tokens"], calibration.info["seconds"],
             calibration.summary(), path)
    return calibration, path
