"""Conversions between SamplingParams and the wire's WireSampling, shared by both ends.

Stop strings never travel: the gateway owns the text and applies them itself.
"""
from __future__ import annotations

from protos import worker_pb2
from shared.sampling_params import SamplingParams


def sampling_to_wire(params: SamplingParams) -> worker_pb2.WireSampling:
    wire = worker_pb2.WireSampling(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos)
    if params.seed is not None:
        wire.seed = params.seed
    return wire


def sampling_from_wire(wire: worker_pb2.WireSampling) -> SamplingParams:
    return SamplingParams(
        max_tokens=wire.max_tokens, temperature=wire.temperature, top_p=wire.top_p, top_k=wire.top_k,
        min_p=wire.min_p, repetition_penalty=wire.repetition_penalty,
        seed=wire.seed if wire.HasField("seed") else None,
        stop_token_ids=tuple(wire.stop_token_ids), ignore_eos=wire.ignore_eos)
