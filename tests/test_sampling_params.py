"""SamplingParams: every field's validation (message names field, value and range), conversions, from_dict/to_dict."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.sampling_params import SamplingParams


def test_defaults():
    p = SamplingParams()
    assert p.max_tokens == 16
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.repetition_penalty == 1.0
    assert p.seed is None
    assert p.stop_token_ids == ()
    assert p.stop == ()
    assert p.ignore_eos is False
    assert p.logprobs is False
    assert p.is_greedy is False


def test_is_greedy_only_at_zero_temperature():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-6).is_greedy


def test_frozen_and_hashable():
    p = SamplingParams(stop_token_ids=[1, 2])
    with pytest.raises(AttributeError):
        p.top_k = 3  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(stop_token_ids=(1, 2)))


def test_accepted_boundaries():
    p = SamplingParams(
        max_tokens=1, temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, repetition_penalty=1e-3, seed=2**63 - 1
    )
    assert (p.max_tokens, p.top_k, p.seed) == (1, 1, 2**63 - 1)
    assert SamplingParams(top_p=1e-9, min_p=0.0, seed=0).seed == 0


def test_ints_given_for_floats_become_floats():
    p = SamplingParams(temperature=1, top_p=1, min_p=0, repetition_penalty=2)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        assert type(getattr(p, name)) is float, name
    assert p.repetition_penalty == 2.0


def test_lists_become_tuples():
    p = SamplingParams(stop_token_ids=[7, 0, 7], stop=["###", "\n\n"])
    assert p.stop_token_ids == (7, 0, 7)
    assert p.stop == ("###", "\n\n")
    assert isinstance(p.stop_token_ids, tuple) and isinstance(p.stop, tuple)


def test_bare_stop_string_is_one_stop_string():
    assert SamplingParams(stop="END").stop == ("END",)


# (kwargs, substrings the message must contain: field name, bad value, allowed range)
INVALID = [
    ({"max_tokens": 0}, ["max_tokens", "got 0", ">= 1"]),
    ({"max_tokens": -5}, ["max_tokens", "got -5", ">= 1"]),
    ({"max_tokens": 16.0}, ["max_tokens", "got 16.0", "int"]),
    ({"max_tokens": True}, ["max_tokens", "got True", "int"]),
    ({"max_tokens": "16"}, ["max_tokens", "got '16'"]),
    ({"max_tokens": None}, ["max_tokens", "got None"]),
    ({"temperature": -0.1}, ["temperature", "got -0.1", ">= 0"]),
    ({"temperature": float("nan")}, ["temperature", "got nan", ">= 0"]),
    ({"temperature": float("inf")}, ["temperature", "got inf", "finite"]),
    ({"temperature": True}, ["temperature", "got True"]),
    ({"temperature": "0.7"}, ["temperature", "got '0.7'"]),
    ({"top_p": 1.5}, ["top_p must be in (0, 1], got 1.5"]),
    ({"top_p": 0.0}, ["top_p must be in (0, 1], got 0.0"]),
    ({"top_p": -0.2}, ["top_p", "got -0.2", "(0, 1]"]),
    ({"top_p": float("nan")}, ["top_p", "got nan", "(0, 1]"]),
    ({"top_p": float("-inf")}, ["top_p", "got -inf"]),
    ({"top_k": -1}, ["top_k", "got -1", ">= 1"]),
    ({"top_k": 2.5}, ["top_k", "got 2.5"]),
    ({"top_k": False}, ["top_k", "got False"]),
    ({"min_p": 1.01}, ["min_p", "got 1.01", "[0, 1]"]),
    ({"min_p": -0.01}, ["min_p", "got -0.01", "[0, 1]"]),
    ({"min_p": float("nan")}, ["min_p", "got nan"]),
    ({"repetition_penalty": 0.0}, ["repetition_penalty", "got 0.0", "> 0"]),
    ({"repetition_penalty": -1.0}, ["repetition_penalty", "got -1.0", "> 0"]),
    ({"repetition_penalty": float("inf")}, ["repetition_penalty", "got inf"]),
    ({"repetition_penalty": float("nan")}, ["repetition_penalty", "got nan"]),
    ({"seed": -1}, ["seed", "got -1", "[0, 2**63)"]),
    ({"seed": 2**63}, ["seed", f"got {2**63}", "[0, 2**63)"]),
    ({"seed": 1.0}, ["seed", "got 1.0"]),
    ({"seed": True}, ["seed", "got True"]),
    ({"stop_token_ids": [1, -2]}, ["stop_token_ids[1]", "got -2", ">= 0"]),
    ({"stop_token_ids": [1, True]}, ["stop_token_ids[1]", "got True"]),
    ({"stop_token_ids": [1.0]}, ["stop_token_ids[0]", "got 1.0"]),
    ({"stop_token_ids": 5}, ["stop_token_ids", "got 5", "list or tuple"]),
    ({"stop_token_ids": "12"}, ["stop_token_ids", "got '12'"]),
    ({"stop": ["ok", 3]}, ["stop[1]", "got 3", "str"]),
    ({"stop": [b"x"]}, ["stop[0]", "got b'x'"]),
    ({"stop": [""]}, ["stop[0]", "non-empty"]),
    ({"stop": 3}, ["stop", "got 3"]),
    ({"ignore_eos": 1}, ["ignore_eos", "got 1", "bool"]),
    ({"logprobs": "yes"}, ["logprobs", "got 'yes'", "bool"]),
    ({"logprobs": None}, ["logprobs", "got None", "bool"]),
]


@pytest.mark.parametrize("kwargs, expected", INVALID, ids=[repr(k) for k, _ in INVALID])
def test_invalid_values_raise_with_field_value_and_range(kwargs, expected):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    message = str(excinfo.value)
    for part in expected:
        assert part in message, (part, message)


def test_from_dict_defaults_and_values():
    assert SamplingParams.from_dict({}) == SamplingParams()
    p = SamplingParams.from_dict({"temperature": 0, "stop_token_ids": [2], "seed": 3})
    assert p == SamplingParams(temperature=0.0, stop_token_ids=(2,), seed=3)


def test_from_dict_rejects_unknown_keys_naming_them():
    with pytest.raises(ValueError) as excinfo:
        SamplingParams.from_dict({"top-p": 0.9, "temprature": 0.5, "top_k": 3})
    message = str(excinfo.value)
    assert "'top-p'" in message and "'temprature'" in message
    assert "'top_k'" not in message.split(";")[0]


def test_from_dict_validates_values_and_type():
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams.from_dict({"top_p": 2})
    with pytest.raises(ValueError, match="mapping"):
        SamplingParams.from_dict([("top_p", 0.5)])  # type: ignore[arg-type]


def test_to_dict_is_json_friendly_and_round_trips():
    p = SamplingParams(max_tokens=3, temperature=0.5, seed=9, stop_token_ids=(1, 2), stop=("a",), logprobs=True)
    d = p.to_dict()
    assert d["stop_token_ids"] == [1, 2] and d["stop"] == ["a"]
    assert SamplingParams.from_dict(json.loads(json.dumps(d))) == p


@settings(max_examples=60, deadline=None)
@given(
    max_tokens=st.integers(1, 10**6),
    temperature=st.floats(0, 100, allow_nan=False),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(0, 10**6),
    min_p=st.floats(0, 1),
    repetition_penalty=st.floats(1e-6, 1e6),
    seed=st.none() | st.integers(0, 2**63 - 1),
    stop_token_ids=st.lists(st.integers(0, 2**31)),
    stop=st.lists(st.text(min_size=1)),
    ignore_eos=st.booleans(),
    logprobs=st.booleans(),
)
def test_every_valid_combination_is_accepted_and_round_trips(**kwargs):
    p = SamplingParams(**kwargs)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert p.is_greedy == (kwargs["temperature"] == 0)
    assert math.isfinite(p.temperature)

