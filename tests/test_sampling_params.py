"""SamplingParams: every field's validation (message names field, value and range), conversions, from_dict/to_dict."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shared.sampling_params import MAX_TOP_LOGPROBS, SamplingParams


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
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias, p.min_tokens, p.top_logprobs) == (0.0, 0.0, (), 0, 0)
    assert MAX_TOP_LOGPROBS == 20  # OpenAI's chat bound
    assert SamplingParams(logprobs=True, top_logprobs=20).top_logprobs == 20


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


def test_openai_fields_accept_their_boundaries_and_normalise():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, min_tokens=16, max_tokens=16, logprobs=True,
                       top_logprobs=5, logit_bias={9: 100, 0: -100.0, 4: 0.5})
    assert type(p.presence_penalty) is float and p.presence_penalty == -2.0 and p.frequency_penalty == 2.0
    assert (p.min_tokens, p.top_logprobs) == (16, 5)
    # Sorted by id, ints as floats, one normal form for a mapping and for pairs.
    assert p.logit_bias == ((0, -100.0), (4, 0.5), (9, 100.0))
    assert all(type(b) is float for _, b in p.logit_bias)
    assert SamplingParams(logit_bias=[(9, 100), [0, -100.0], (4, 0.5)]).logit_bias == p.logit_bias
    assert SamplingParams(logit_bias=()).logit_bias == () and SamplingParams(logit_bias={}).logit_bias == ()
    assert hash(p) == hash(SamplingParams(**{**p.to_dict()}))


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
    ({"presence_penalty": 2.5}, ["presence_penalty", "got 2.5", "[-2, 2]"]),
    ({"presence_penalty": -2.01}, ["presence_penalty", "got -2.01", "[-2, 2]"]),
    ({"presence_penalty": float("nan")}, ["presence_penalty", "got nan", "finite"]),
    ({"presence_penalty": "1"}, ["presence_penalty", "got '1'"]),
    ({"presence_penalty": True}, ["presence_penalty", "got True"]),
    ({"frequency_penalty": 3}, ["frequency_penalty", "got 3", "[-2, 2]"]),
    ({"frequency_penalty": float("-inf")}, ["frequency_penalty", "got -inf"]),
    ({"frequency_penalty": None}, ["frequency_penalty", "got None"]),
    ({"logit_bias": {5: 100.5}}, ["logit_bias[5]", "got 100.5", "[-100, 100]"]),
    ({"logit_bias": {5: -101}}, ["logit_bias[5]", "got -101", "[-100, 100]"]),
    ({"logit_bias": {5: float("nan")}}, ["logit_bias[5]", "got nan"]),
    ({"logit_bias": {5: "1"}}, ["logit_bias[5]", "got '1'"]),
    ({"logit_bias": {-1: 1.0}}, ["logit_bias token id", "got -1", ">= 0"]),
    ({"logit_bias": {"50256": 1.0}}, ["logit_bias token id", "got '50256'", "int"]),
    ({"logit_bias": {1.0: 1.0}}, ["logit_bias token id", "got 1.0"]),
    ({"logit_bias": {True: 1.0}}, ["logit_bias token id", "got True"]),
    ({"logit_bias": [(1, 2.0), (1, 3.0)]}, ["logit_bias", "token id 1", "more than one"]),
    ({"logit_bias": [(1, 2.0, 3.0)]}, ["logit_bias[0]", "pair", "got (1, 2.0, 3.0)"]),
    ({"logit_bias": [5]}, ["logit_bias[0]", "pair", "got 5"]),
    ({"logit_bias": 5}, ["logit_bias", "got 5", "mapping"]),
    ({"logit_bias": "5:1"}, ["logit_bias", "got '5:1'"]),
    ({"min_tokens": -1}, ["min_tokens", "got -1", "[0, max_tokens=16]"]),
    ({"min_tokens": 17}, ["min_tokens", "got 17", "[0, max_tokens=16]"]),
    ({"min_tokens": 5, "max_tokens": 4}, ["min_tokens", "got 5", "[0, max_tokens=4]"]),
    ({"min_tokens": 1.0}, ["min_tokens", "got 1.0", "int"]),
    ({"min_tokens": True}, ["min_tokens", "got True"]),
    ({"top_logprobs": 21, "logprobs": True}, ["top_logprobs", "got 21", "[0, 20]"]),
    ({"top_logprobs": -1, "logprobs": True}, ["top_logprobs", "got -1", "[0, 20]"]),
    ({"top_logprobs": 2.0, "logprobs": True}, ["top_logprobs", "got 2.0", "int"]),
    ({"top_logprobs": "2", "logprobs": True}, ["top_logprobs", "got '2'"]),
    ({"top_logprobs": 2}, ["top_logprobs=2", "logprobs=True", "logprobs=False"]),
    ({"prompt_logprobs": 21}, ["prompt_logprobs", "got 21", "[0, 20]"]),
    ({"prompt_logprobs": -1}, ["prompt_logprobs", "got -1", "[0, 20]"]),
    ({"prompt_logprobs": True}, ["prompt_logprobs", "got True"]),
    ({"speculative_ngram_k": 33}, ["speculative_ngram_k", "got 33", "the server's default", "[0, 32]"]),
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
    p = SamplingParams(max_tokens=3, temperature=0.5, seed=9, stop_token_ids=(1, 2), stop=("a",), logprobs=True,
                       top_logprobs=4, presence_penalty=0.5, frequency_penalty=-1.25, min_tokens=2,
                       logit_bias={7: -3.5, 2: 100.0})
    d = p.to_dict()
    assert d["stop_token_ids"] == [1, 2] and d["stop"] == ["a"]
    assert d["logit_bias"] == [[2, 100.0], [7, -3.5]]
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
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    logit_bias=st.dictionaries(st.integers(0, 2**31), st.floats(-100, 100)),
    min_tokens=st.integers(0, 10**6),
    top_logprobs=st.integers(0, MAX_TOP_LOGPROBS),
)
def test_every_valid_combination_is_accepted_and_round_trips(**kwargs):
    assume(kwargs["min_tokens"] <= kwargs["max_tokens"])
    assume(kwargs["logprobs"] or kwargs["top_logprobs"] == 0)
    p = SamplingParams(**kwargs)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert p.is_greedy == (kwargs["temperature"] == 0)
    assert math.isfinite(p.temperature)

