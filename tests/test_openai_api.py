"""The OpenAI-compatible HTTP API's outputs through the official `openai` client (sync and async), against a
real gateway and two real workers: equal to the gRPC path's and the engine's; n, logprobs, stop, echo."""
from __future__ import annotations

import asyncio

import openai
import pytest

import openai_api_harness as harness
from bench.cluster_process import free_port
from cluster_harness import Cluster, generate
from openai_api_harness import MODEL, greedy

pytestmark = pytest.mark.timeout(300)
# The harness's module-scoped fixtures, bound here for pytest to find: each module starts its own cluster.
cluster, base_url, client, engine = harness.cluster, harness.base_url, harness.client, harness.engine


# ---- equality with the gRPC path and the engine -----------------------------------------------------
def test_greedy_completion_equals_grpc_and_engine(client, cluster, engine, tokenizer):
    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt)
    expected = greedy(engine, ids, 24, ignore_eos=True).token_ids
    grpc_ids, grpc_text, _ = generate(cluster.stub, prompt=prompt,
                                      sampling=dict(max_tokens=24, temperature=0.0, ignore_eos=True))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    [choice] = r.choices
    assert choice.token_ids == expected == grpc_ids
    assert choice.prompt_token_ids == ids
    assert choice.text == grpc_text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 24
    assert r.usage.total_tokens == len(ids) + 24
    assert r.model == MODEL and r.object == "text_completion"


def test_streamed_chat_equals_unstreamed_and_engine(client, engine, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo wörld"}]
    ids = tokenizer.encode_chat(messages)
    expected = greedy(engine, ids, 20, ignore_eos=True).token_ids
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    assert whole.choices[0].token_ids == expected
    assert whole.prompt_token_ids == ids
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True, "ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert content == whole.choices[0].message.content == tokenizer.decode(expected)
    assert streamed_ids == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.usage.prompt_tokens == len(ids)


def test_a_chat_without_max_tokens_runs_to_the_context_within_the_kv_pool(served_checkpoint):
    """OpenAI's and vLLM's default for a chat: as many tokens as fit, here the worker's 8-block
    pool (128 tokens), not the model's 8192 positions; a plain prompt keeps the gateway's default."""
    sections = {"gateway": {"http_port": free_port(), "default_max_tokens": 5},
                "worker": {"num_kv_blocks": 8, "block_size": 16}}
    with Cluster(served_checkpoint, num_workers=1, sections=sections) as small, \
            openai.OpenAI(base_url=f"http://127.0.0.1:{small.http_port}/v1", api_key="unused", max_retries=0,
                          timeout=60) as c:
        chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go on"}],
                                         extra_body={"ignore_eos": True})
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 8 * 16
        plain = c.completions.create(model=MODEL, prompt="go on", extra_body={"ignore_eos": True})
        assert plain.usage.completion_tokens == 5


def test_text_parts_render_like_a_string(client):
    as_string = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a\nb"}],
                                               max_tokens=6, temperature=0)
    as_parts = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_tokens=6, temperature=0)
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content


def test_async_client_prompt_forms(base_url, engine, tokenizer):
    prompts = ["The quick brown fox", "Paged attention"]
    ids = [tokenizer.encode(p) for p in prompts]
    expected = [greedy(engine, i, 12, ignore_eos=True).token_ids for i in ids]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
            extra = {"return_token_ids": True, "ignore_eos": True}
            by_text = await client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0,
                                                      extra_body=extra)
            by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                                     extra_body=extra)
            one_ids = await client.completions.create(model=MODEL, prompt=ids[1], max_tokens=12, temperature=0,
                                                      extra_body=extra)
            stream = await client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0,
                                                     stream=True, extra_body=extra)
            streamed = [c async for c in stream]
            return by_text, by_ids, one_ids, streamed

    by_text, by_ids, one_ids, streamed = asyncio.run(run())
    assert [c.token_ids for c in by_text.choices] == expected == [c.token_ids for c in by_ids.choices]
    assert [c.index for c in by_text.choices] == [0, 1]
    assert one_ids.choices[0].token_ids == expected[1]
    assert [t for c in streamed for t in (c.choices[0].model_extra.get("token_ids") or [])] == expected[0]
    assert "".join(c.choices[0].text for c in streamed) == by_text.choices[0].text


# ---- n, logprobs, stop, echo ------------------------------------------------------------------------
def test_n_choices_identical_when_greedy_and_distinct_when_seeded(client):
    greedy_choices = client.completions.create(model=MODEL, prompt="Hello", n=3, max_tokens=16, temperature=0,
                                               extra_body={"return_token_ids": True, "ignore_eos": True}).choices
    assert [c.index for c in greedy_choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in greedy_choices}) == 1
    seeded = client.completions.create(model=MODEL, prompt="Hello", n=3, max_tokens=16, temperature=1.0, seed=7,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    assert len({tuple(c.token_ids) for c in seeded.choices}) == 3
    again = client.completions.create(model=MODEL, prompt="Hello", n=3, max_tokens=16, temperature=1.0, seed=7,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in seeded.choices]
    assert seeded.usage.completion_tokens == 48 and seeded.usage.prompt_tokens == len(seeded.choices[0].prompt_token_ids)
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3,
                                                   max_tokens=8, temperature=0, stream=True))
    by_index: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + (c.delta.content or "")
    assert sorted(by_index) == [0, 1, 2] and len(set(by_index.values())) == 1


def test_logprobs_equal_the_engines(client, engine, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    expected = greedy(engine, ids, 10, ignore_eos=True, logprobs=True, top_logprobs=3)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, logprobs=3,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].token_ids == expected.token_ids
    assert all(abs(a - b) <= 1e-5 for a, b in zip(lp.token_logprobs, expected.logprobs, strict=True))
    for top, chosen_lp in zip(lp.top_logprobs, lp.token_logprobs):
        values = list(top.values())
        assert values == sorted(values, reverse=True)
        assert abs(max(values) - chosen_lp) <= 1e-6  # greedy: the chosen token is the most likely one
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in expected.token_ids]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0.8, seed=3, logprobs=True, top_logprobs=20,
                                          extra_body={"return_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == len(chat.choices[0].token_ids)
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 20 and tops == sorted(tops, reverse=True)  # OpenAI's chat bound
        # Sampled, not greedy: the chosen token is at most as likely as the most likely one.
        assert entry.logprob <= tops[0] + 1e-6 and entry.logprob <= 0
        # A whole character's token has its text's bytes; a part of one has its raw bytes.
        assert entry.bytes == list(entry.token.encode()) or "\ufffd" in entry.token


def test_stop_strings_and_echo(client, tokenizer):
    base = client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[5:8]
    assert stop and stop not in base[:5]
    stopped = client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.text == base[:base.index(stop)] and stopped.finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=0, stop=stop,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == stopped.text
    assert streamed[-1].choices[0].finish_reason == "stop"
    echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True}).choices[0]
    assert echoed.text == "Hello" + base
    echoed_ids = client.completions.create(model=MODEL, prompt=tokenizer.encode("Hello"), max_tokens=4,
                                           temperature=0, echo=True).choices[0]
    assert echoed_ids.text.startswith(tokenizer.decode(tokenizer.encode("Hello")))


def test_what_ended_the_text_is_left_out_unless_asked_for_as_vllm_does(client, tokenizer):
    """vLLM's include_stop_str_in_output and skip_special_tokens: a stop string, a stop token and EOS
    end the text before them unless it keeps them; special tokens' text is written out on request."""
    def text(stream: bool = False, **fields) -> tuple[str, list[int]]:
        extra = {"ignore_eos": True, "return_token_ids": True, **fields.pop("extra", {})}
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 30, "temperature": 0, "extra_body": extra, **fields}
        if stream:
            chunks = list(client.completions.create(**body, stream=True))
            return "".join(c.choices[0].text for c in chunks), [t for c in chunks for t in c.choices[0].token_ids]
        choice = client.completions.create(**body).choices[0]
        return choice.text, choice.token_ids

    base, base_ids = text()
    stop = base[5:8]
    keep = {"include_stop_str_in_output": True}
    for stream in (False, True):
        assert text(stream, stop=[stop], extra=keep)[0] == base[:base.index(stop) + len(stop)]
    # A stop token that is ordinary text: its id is in the output, its text only where kept.
    k = next(i for i in range(3, len(base_ids)) if base_ids[i] not in base_ids[:i])
    token = base_ids[k]
    for stream in (False, True):
        assert text(stream, extra={"stop_token_ids": [token]}) == (tokenizer.decode(base_ids[:k]), base_ids[:k + 1])
        assert text(stream, extra={"stop_token_ids": [token], **keep})[0] == tokenizer.decode(base_ids[:k + 1])
    # EOS pushed to the top: its text is "" unless special tokens are written out, and then only
    # where it does not end the output or is kept.
    eos = tokenizer.special.eos_ids[0]
    forced = {"logit_bias": {str(eos): 100}, "max_tokens": 3}
    assert text(**forced)[0] == ""
    assert text(**forced, extra={"skip_special_tokens": False})[0] == "</s>" * 3
    ended = {"ignore_eos": False, "skip_special_tokens": False}
    assert text(**forced, extra=ended) == ("", [eos])
    assert text(True, **forced, extra={**ended, **keep}) == ("</s>", [eos])


def test_sampling_extensions_reach_the_worker(client, engine, tokenizer):
    ids = tokenizer.encode("Hello")
    eos = tokenizer.special.eos_ids[0]
    # Pushing EOS up makes it the greedy choice at once, unless min_tokens holds it back.
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0, logit_bias={str(eos): 100},
                                  extra_body={"min_tokens": 5, "return_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and len(choice.token_ids) == 6 and choice.token_ids[-1] == eos
    expected = greedy(engine, ids, 12, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5).token_ids
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, presence_penalty=1.5,
                                  frequency_penalty=0.5, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].token_ids == expected


def test_grpc_logprobs_match_http(client, cluster, tokenizer):
    ids = tokenizer.encode("Hello")
    from protos import inference_pb2
    request = inference_pb2.GenerateRequest(prompt_token_ids=ids, sampling=inference_pb2.SamplingOptions(
        max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True))
    entries = [lp for response in cluster.stub.Generate(request, timeout=30) for lp in response.logprobs]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=2,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [e.token_id for e in entries] == r.choices[0].token_ids
    assert [round(e.logprob, 5) for e in entries] == [round(x, 5) for x in r.choices[0].logprobs.token_logprobs]
    assert all(len(e.top) == 2 and e.top[0].logprob >= e.top[1].logprob for e in entries)


def test_logprob_bytes_rebuild_the_text_and_streamed_offsets_equal_whole(client):
    # Special tokens (ids 0-2) are kept out, so the bytes of the tokens are exactly the text's.
    no_specials = {str(t): -100 for t in (0, 1, 2)}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "héllo wörld 日本語"}],
                                          max_tokens=24, temperature=0, logprobs=True, logit_bias=no_specials,
                                          extra_body={"ignore_eos": True})
    raw = b"".join(bytes(e.bytes) for e in chat.choices[0].logprobs.content)
    assert raw.decode("utf-8", errors="replace") == chat.choices[0].message.content
    fields = dict(model=MODEL, prompt="héllo wörld", max_tokens=24, temperature=0, logprobs=2, echo=False,
                  logit_bias=no_specials, extra_body={"ignore_eos": True})
    whole = client.completions.create(**fields).choices[0].logprobs
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **fields)
                if c.choices[0].logprobs is not None]
    assert [o for lp in streamed for o in lp.text_offset] == whole.text_offset
    assert [t for lp in streamed for t in lp.tokens] == whole.tokens


def test_the_end_of_sequence_token_has_no_logprob_entry(client):
    """An answer that ends on EOS counts it in usage, but its text has none of it, and neither do
    its log-probabilities (OpenAI lists no end token), whole or streamed."""
    eos_after_four = dict(model=MODEL, max_tokens=16, temperature=0, logit_bias={"0": -100, "1": -100, "2": 100},
                          extra_body={"min_tokens": 4})
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hello"}], logprobs=True,
                                          **eos_after_four)
    choice = chat.choices[0]
    assert choice.finish_reason == "stop" and chat.usage.completion_tokens == 5
    assert len(choice.logprobs.content) == 4
    raw = b"".join(bytes(e.bytes) for e in choice.logprobs.content)
    assert raw.decode("utf-8", errors="replace") == choice.message.content
    whole = client.completions.create(prompt="hello", logprobs=1, **eos_after_four).choices[0]
    assert whole.finish_reason == "stop" and "".join(whole.logprobs.tokens) == whole.text
    assert len(whole.logprobs.tokens) == len(whole.logprobs.text_offset) == 4
    streamed = [c.choices[0].logprobs for c in client.completions.create(prompt="hello", logprobs=1, stream=True,
                                                                         **eos_after_four)
                if c.choices[0].logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == whole.logprobs.tokens
    assert [o for lp in streamed for o in lp.text_offset] == whole.logprobs.text_offset


# ---- the prompt's log-probabilities -----------------------------------------------------------------
def _engine_prompt_logprobs(engine, ids: list[int], k: int):
    return greedy(engine, ids, 1, ignore_eos=True, logprobs=True, top_logprobs=k, prompt_logprobs=k)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_harness_asks(client, engine, tokenizer):
    """lm-evaluation-harness's loglikelihood request: token-id prompts in a batch, echo, logprobs 1,
    max_tokens 1; it reads token_logprobs[context:-1] and compares each with max(top_logprobs)."""
    prompts = [tokenizer.encode("The quick brown fox jumps"), tokenizer.encode("Hello there, world")]
    r = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0,
                                  extra_body={"ignore_eos": True})
    for ids, choice in zip(prompts, sorted(r.choices, key=lambda c: c.index)):
        expected = _engine_prompt_logprobs(engine, ids, 1)
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing comes before the first
        scored = [logprob for logprob, _, _ in expected.prompt_logprobs] + expected.logprobs
        assert lp.token_logprobs[1:] == pytest.approx(scored, abs=1e-5)
        tops = [top for _, _, top in expected.prompt_logprobs] + expected.top_logprobs
        # The most likely one, then the token's own where it is another: OpenAI's "up to logprobs + 1".
        assert [list(t.values())[:1] for t in lp.top_logprobs[1:]] == [pytest.approx([v for _, v in top], abs=1e-5)
                                                                       for top in tops]
        assert all(token in top and len(top) <= 2 for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
        assert any(len(top) == 2 for top in lp.top_logprobs[1:])  # a prompt is rarely its model's first choice
        assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids + expected.token_ids]
        assert choice.text == tokenizer.decode(ids) + tokenizer.decode(expected.token_ids)
        # Offsets index the echoed text (whose BOS is not written out), then the generated text.
        assert [choice.text[o:o + len(t)] for o, t in zip(lp.text_offset[1:], lp.tokens[1:])] == lp.tokens[1:]


def test_an_echo_that_generates_eos_keeps_a_place_for_it(client, tokenizer):
    """lm-evaluation-harness reads token_logprobs[context:-1]: the one generated token has its place even
    where it is EOS, whose text the answer leaves out (without an echo it has no entry, as OpenAI's)."""
    ids = tokenizer.encode("The quick brown fox")
    eos = tokenizer.special.eos_ids[0]
    fields = dict(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0,
                  logit_bias={str(eos): 100})
    whole = client.completions.create(**fields).choices[0]
    assert whole.finish_reason == "stop" and whole.text == tokenizer.decode(ids)
    # Its value is the raw one (before the bias).
    assert len(whole.logprobs.token_logprobs) == len(ids) + 1 and whole.logprobs.token_logprobs[-1] < 0
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **fields)
                if c.choices[0].logprobs]
    assert [x for lp in streamed for x in lp.token_logprobs] == whole.logprobs.token_logprobs
    plain = client.completions.create(**{**fields, "echo": False}).choices[0]
    assert plain.logprobs.tokens == []


def test_echo_with_logprobs_streamed_equals_whole(client, tokenizer):
    fields = dict(model=MODEL, prompt="Once upon a time", echo=True, logprobs=2, max_tokens=5, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**fields).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **fields)]
    # As vLLM streams it: the prompt comes with the first token, and its log-probabilities with it.
    assert chunks[0].text.startswith("Once upon a time") and chunks[0].logprobs.token_logprobs[0] is None
    assert "".join(c.text for c in chunks) == whole.text
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks if c.logprobs for x in getattr(c.logprobs, name)] == getattr(whole.logprobs, name)


def test_vllm_prompt_logprobs_field_and_grpc(client, cluster, engine, tokenizer):
    ids = tokenizer.encode("Once upon a time there")
    expected = _engine_prompt_logprobs(engine, ids, 3).prompt_logprobs
    completion = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                           extra_body={"prompt_logprobs": 3}).choices[0]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    for places, prompt_ids, k in ((completion.model_extra["prompt_logprobs"], ids, 3),
                                  (chat.model_extra["prompt_logprobs"], tokenizer.encode_chat([{"role": "user",
                                                                                                "content": "hi"}]), 0)):
        assert len(places) == len(prompt_ids) and places[0] is None
        for token_id, place in zip(prompt_ids[1:], places[1:]):
            entry = place[str(token_id)]  # the prompt's token, and the k most likely ranked 1..k
            assert entry["decoded_token"] == tokenizer.decode([token_id], skip_special_tokens=False)
            assert entry["rank"] >= 1 and len(place) <= k + 1
            # The alternatives ranked 1..k, but for the prompt's own token where it is one of them.
            ranks = {e["rank"] for t, e in place.items() if t != str(token_id)}
            assert ranks == set(range(1, k + 1)) - {entry["rank"]}
    for (logprob, rank, top), token_id, place in zip(expected, ids[1:], completion.model_extra["prompt_logprobs"][1:]):
        assert place[str(token_id)]["logprob"] == pytest.approx(logprob, abs=1e-5)
        assert place[str(token_id)]["rank"] == rank
        assert {int(t) for t in place} == {token_id, *(t for t, _ in top)}

    from protos import inference_pb2
    request = inference_pb2.GenerateRequest(prompt_token_ids=ids, sampling=inference_pb2.SamplingOptions(
        max_tokens=3, temperature=0.0, prompt_logprobs=3, ignore_eos=True))
    responses = list(cluster.stub.Generate(request, timeout=30))
    assert [len(r.prompt_logprobs) for r in responses if r.token_ids][0] == len(ids) - 1
    assert sum(len(r.prompt_logprobs) for r in responses) == len(ids) - 1  # on the first message only
    entries = next(r.prompt_logprobs for r in responses if r.prompt_logprobs)
    assert [e.token_id for e in entries] == ids[1:] and [e.rank for e in entries] == [r for _, r, _ in expected]
    assert [e.logprob for e in entries] == pytest.approx([lp for lp, _, _ in expected], abs=1e-5)
    assert [[(t.token_id, round(t.logprob, 4)) for t in e.top] for e in entries] == [
        [(t, round(v, 4)) for t, v in top] for _, _, top in expected]

    for body, message in (({"prompt_logprobs": 2, "stream": True}, "not available with stream"),
                          ({"prompt_logprobs": 21}, r"prompt_logprobs must be in \[0, 20\]")):
        with pytest.raises(openai.BadRequestError, match=message) as refused:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=body)
        assert refused.value.body["param"] == "prompt_logprobs"


def test_echo_with_max_tokens_0_answers_the_scored_prompt_alone(client, engine, tokenizer):
    """vLLM's scoring form: echo, logprobs and max_tokens 0 answer the prompt and its log-probabilities,
    nothing generated (whole and streamed)."""
    ids = tokenizer.encode("The quick brown fox")
    expected = _engine_prompt_logprobs(engine, ids, 2).prompt_logprobs
    fields = dict(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=0,
                  extra_body={"return_token_ids": True})
    r = client.completions.create(**fields)
    choice = r.choices[0]
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length" and choice.token_ids == []
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([lp for lp, _, _ in expected], abs=1e-5)
    assert r.usage.completion_tokens == 0 and r.usage.total_tokens == r.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **fields))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [x for c in chunks if c.choices and c.choices[0].logprobs
            for x in c.choices[0].logprobs.token_logprobs] == choice.logprobs.token_logprobs
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=0)  # without echo there is nothing to answer


def test_add_special_tokens_false_encodes_a_text_prompt_without_its_bos(client, tokenizer):
    """vLLM's add_special_tokens reaches the prompt's encoding: lm-evaluation-harness's text requests
    (tokenized_requests false) score the text as its own tokenizer encodes it, without a BOS."""
    text = "The quick brown fox"
    with_bos = client.completions.create(model=MODEL, prompt=text, max_tokens=1, extra_body={"return_token_ids": True})
    plain = client.completions.create(model=MODEL, prompt=text, max_tokens=1, echo=True, logprobs=0,
                                      extra_body={"return_token_ids": True, "add_special_tokens": False})
    ids = tokenizer.encode(text, add_special_tokens=False)  # this tokenizer adds none (test_gateway_tokenizer's does)
    assert with_bos.choices[0].prompt_token_ids == tokenizer.encode(text)
    assert plain.choices[0].prompt_token_ids == ids and plain.usage.prompt_tokens == len(ids)
    assert plain.choices[0].text.startswith(text) and len(plain.choices[0].logprobs.tokens) == len(ids) + 1


def test_echo_offsets_count_a_special_tokens_text_only_where_the_echo_writes_it(tokenizer):
    from gateway.prompt_logprobs import echoed_logprobs
    from gateway.token_texts import TokenTexts
    texts = TokenTexts(tokenizer)
    eos = tokenizer.special.eos_ids[0]
    spelled = "</s>hello"  # the prompt's text spells the special token out: the echo holds it
    ids = tokenizer.encode(spelled)
    assert eos in ids
    lists = echoed_logprobs(ids, None, 1, texts, spelled)
    assert [spelled[o:o + len(t)] for o, t in zip(lists["text_offset"], lists["tokens"])] == lists["tokens"]
    # Token ids decoded for the echo leave it out: it takes no room there.
    decoded = tokenizer.decode(ids)
    lists = echoed_logprobs(ids, None, 1, texts, decoded)
    assert lists["text_offset"][ids.index(eos) + 1] == lists["text_offset"][ids.index(eos)]
    assert lists["token_logprobs"] == [None] * len(ids)
