"""Per-request sampling parameters: the one validated, immutable description of how a request is decoded.
Pure Python and stdlib only (the gateway imports it too): no torch, no numpy, and no sampling logic here."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

# Seeds must fit a signed 64-bit integer so every torch backend (and any IPC encoding) can hold them.
MAX_SEED = 2**63
# OpenAI's ranges: penalties in [-2, 2], a logit bias in [-100, 100] (enough to force or ban a token
# outright), and up to 20 alternatives per token (its chat API's bound; its completions API takes 5).
MAX_TOP_LOGPROBS = 20
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# The most draft tokens a step may verify per request (speculative decoding by prompt lookup): each
# costs a row of the step's logits, and the runner's buffer holds 1 + this many rows per sequence at most.
MAX_SPECULATIVE_NGRAM_K = 32

# What top_logprobs asks for, per sampled token: (token id, raw logprob) pairs by descending logprob, ties by
# ascending id. Named once here, since the sampler, the worker's outputs and the wire all carry it.
TopLogprobs = tuple[tuple[int, float], ...]
# What prompt_logprobs asks for, per prompt token after the first: (its raw logprob, its rank in the vocabulary
# (1 + the tokens more likely than it), its top alternatives).
PromptLogprob = tuple[float, int, TopLogprobs]


def _check_int(name: str, value: Any, allowed: str) -> int:
    """Coerce an int-like (int, or anything with __index__ such as a numpy int); the caller range-checks it."""
    # bool is an int subclass, but True as max_tokens is always a caller bug.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be {allowed}, got {value!r}") from None
    return as_int


def _check_float(name: str, value: Any, allowed: str) -> float:
    """Coerce a real number (int or float, not bool) to a finite float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    as_float = float(value)
    # NaN compares false with everything, so it would slip through every range check below.
    if not math.isfinite(as_float):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return as_float


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request. Validated on construction; ValueError names field, value, range."""

    max_tokens: int = 16  # >= 1
    temperature: float = 1.0  # >= 0; 0 means greedy
    top_p: float = 1.0  # (0, 1]; 1 disables
    top_k: int = 0  # 0 disables, else >= 1
    min_p: float = 0.0  # [0, 1]; 0 disables
    repetition_penalty: float = 1.0  # > 0; 1 disables; HF/CTRL semantics over prompt + generated tokens
    seed: int | None = None  # per-request seed, 0 <= seed < 2**63
    stop_token_ids: tuple[int, ...] = ()  # lists accepted and converted to tuple
    stop: tuple[str, ...] = ()  # applied by the gateway's detokenizer; carried here only
    # The gateway's too: the text keeps what ended it (stop string, stop token, EOS), and special
    # tokens' text is written out (vLLM's include_stop_str_in_output, skip_special_tokens).
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-probability of each chosen token
    # OpenAI semantics over the GENERATED tokens only (not the prompt), resumed ones included:
    # logit[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t]. [-2, 2]; 0 disables.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id -> bias in [-100, 100], added to the raw logits before anything else. A mapping or a
    # sequence of (id, bias) pairs is accepted; stored as (id, bias) pairs sorted by id. Ids are >= 0 here;
    # the vocabulary bound is the gateway's check (the sampler refuses an id past it).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # While fewer tokens than this have been generated, EOS and stop_token_ids cannot be sampled (stop strings,
    # the gateway's, are unaffected). 0 <= min_tokens <= max_tokens.
    min_tokens: int = 0
    # How many most likely alternatives to report with each chosen token's logprob; needs logprobs=True.
    top_logprobs: int = 0  # [0, MAX_TOP_LOGPROBS]
    # An llguidance grammar (JSON text) every sampled token must keep the output within; "" = none.
    # The gateway builds it from the request's constraint and checks it against the tokenizer.
    grammar: str = ""
    # Speculative decoding by prompt lookup: propose up to this many tokens a step (copied from where the
    # last few tokens occurred before) and verify them in one forward. None: the server's default
    # (speculative_ngram_k); 0: never for this request; the worker caps it at its speculative_ngram_max_k.
    # It changes speed only: greedy and seeded outputs are the same with any value.
    speculative_ngram_k: int | None = None
    # The prompt's log-probabilities (vLLM's prompt_logprobs): for each prompt token after the first, its
    # raw logprob given the tokens before it and its rank, with this many most likely alternatives.
    # None: not computed. A request asking for them takes no prefix-cache hits (every position is computed).
    prompt_logprobs: int | None = None  # None or [0, MAX_TOP_LOGPROBS]

    def __post_init__(self) -> None:
        # frozen=True forbids normal assignment; object.__setattr__ stores the normalised values once, here.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        max_tokens = _check_int("max_tokens", self.max_tokens, "an int >= 1")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        put("max_tokens", max_tokens)

        temperature = _check_float("temperature", self.temperature, "a finite float >= 0")
        if temperature < 0:
            raise ValueError(f"temperature must be a finite float >= 0, got {self.temperature!r}")
        put("temperature", temperature)

        top_p = _check_float("top_p", self.top_p, "in (0, 1]")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        put("top_p", top_p)

        top_k = _check_int("top_k", self.top_k, "0 (disabled) or an int >= 1")
        if top_k < 0:
            raise ValueError(f"top_k must be 0 (disabled) or an int >= 1, got {self.top_k!r}")
        put("top_k", top_k)

        min_p = _check_float("min_p", self.min_p, "in [0, 1]")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        put("min_p", min_p)

        penalty = _check_float("repetition_penalty", self.repetition_penalty, "a finite float > 0")
        if penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite float > 0, got {self.repetition_penalty!r}")
        put("repetition_penalty", penalty)

        if self.seed is not None:
            seed = _check_int("seed", self.seed, "None or an int in [0, 2**63)")
            if not 0 <= seed < MAX_SEED:
                raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
            put("seed", seed)

        put("stop_token_ids", self._normalise_stop_token_ids(self.stop_token_ids))
        put("stop", self._normalise_stop(self.stop))

        for name in ("ignore_eos", "logprobs", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            # Strict: 0/1 or "false" from a JSON body would otherwise be silently truthy/falsy.
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")

        for name in ("presence_penalty", "frequency_penalty"):
            allowed = f"a finite float in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"
            value = _check_float(name, getattr(self, name), allowed)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")
            put(name, value)

        put("logit_bias", self._normalise_logit_bias(self.logit_bias))

        allowed = f"an int in [0, max_tokens={max_tokens}]"
        min_tokens = _check_int("min_tokens", self.min_tokens, allowed)
        if not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"min_tokens must be {allowed}, got {self.min_tokens!r}")
        put("min_tokens", min_tokens)

        allowed = f"an int in [0, {MAX_TOP_LOGPROBS}]"
        top_logprobs = _check_int("top_logprobs", self.top_logprobs, allowed)
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be {allowed}, got {self.top_logprobs!r}")
        if top_logprobs and not self.logprobs:
            # Alternatives without the chosen token's own logprob have nowhere to go in a response.
            raise ValueError(f"top_logprobs={top_logprobs} needs logprobs=True, got logprobs=False")
        put("top_logprobs", top_logprobs)

        if not isinstance(self.grammar, str):
            raise ValueError(f"grammar must be a str (an llguidance grammar), got {type(self.grammar).__name__}")

        for name, most, unset in (("speculative_ngram_k", MAX_SPECULATIVE_NGRAM_K, "None (the server's default)"),
                                  ("prompt_logprobs", MAX_TOP_LOGPROBS, "None")):
            value = getattr(self, name)
            if value is not None:
                allowed = f"{unset} or an int in [0, {most}]"
                k = _check_int(name, value, allowed)
                if not 0 <= k <= most:
                    raise ValueError(f"{name} must be {allowed}, got {value!r}")
                put(name, k)

    @staticmethod
    def _normalise_stop_token_ids(value: Any) -> tuple[int, ...]:
        allowed = "a list or tuple of ints >= 0"
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"stop_token_ids must be {allowed}, got {value!r}")
        out = []
        for i, token_id in enumerate(value):
            as_int = _check_int(f"stop_token_ids[{i}]", token_id, "an int >= 0")
            if as_int < 0:
                raise ValueError(f"stop_token_ids[{i}] must be an int >= 0, got {token_id!r}")
            out.append(as_int)
        return tuple(out)

    @staticmethod
    def _normalise_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
        allowed = "a mapping of token id -> bias, or a list or tuple of (token id, bias) pairs"
        if isinstance(value, Mapping):
            pairs = list(value.items())
        elif isinstance(value, (list, tuple)):
            pairs = list(value)
            for i, pair in enumerate(pairs):
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise ValueError(f"logit_bias[{i}] must be a (token id, bias) pair, got {pair!r}")
        else:
            raise ValueError(f"logit_bias must be {allowed}, got {value!r}")
        bias_range = f"a finite float in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
        out: dict[int, float] = {}
        for token_id, bias in pairs:
            # A JSON object's keys are strings; the caller converts them, so "50256" is refused here, not guessed.
            as_int = _check_int("logit_bias token id", token_id, "an int >= 0")
            if as_int < 0:
                raise ValueError(f"logit_bias token id must be an int >= 0, got {token_id!r}")
            as_float = _check_float(f"logit_bias[{as_int}]", bias, bias_range)
            if not -MAX_LOGIT_BIAS <= as_float <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{as_int}] must be {bias_range}, got {bias!r}")
            if as_int in out:
                # Two biases for one token: adding them or keeping either would be a silent guess.
                raise ValueError(f"logit_bias gives token id {as_int} more than one bias")
            out[as_int] = as_float
        return tuple(sorted(out.items()))

    @staticmethod
    def _normalise_stop(value: Any) -> tuple[str, ...]:
        # A bare string is the OpenAI API's one-stop-string form; tuple("abc") would split it into characters.
        if isinstance(value, str):
            value = (value,)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"stop must be a str or a list or tuple of non-empty str, got {value!r}")
        for i, s in enumerate(value):
            # An empty stop string matches at every position and would end every request at once.
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty str, got {s!r}")
        return tuple(value)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a plain mapping (e.g. a JSON body); missing keys take defaults, unknown keys are an error."""
        if not isinstance(d, Mapping):
            raise ValueError(f"SamplingParams.from_dict expects a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        # A typo such as "top-p" must not silently fall back to the default.
        unknown = sorted(repr(k) for k in d if k not in known)
        if unknown:
            raise ValueError(
                f"unknown SamplingParams field(s): {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
            )
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly dict (tuples become lists); from_dict(to_dict()) round-trips."""
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["stop"] = list(self.stop)
        # Pairs rather than {str(id): bias}: JSON keys are strings, and ids are never guessed from strings.
        d["logit_bias"] = [[token_id, bias] for token_id, bias in self.logit_bias]
        return d
