"""/tokenize and /detokenize on the real gateway in front of a model-free worker: the ids are those
transformers' tokenizer gives for the same prompt or chat (template, tools, special tokens) and
those a completion or chat request with them sends the model; text comes back as transformers
decodes it; bad input is a 400 naming the field."""
from __future__ import annotations

import httpx2 as httpx
import pytest
from transformers import AutoTokenizer

from bench.cluster_process import free_port
from gateway_fake_cluster import FakeCluster

pytestmark = pytest.mark.timeout(300)
MODEL = "llama"
MAX_PROMPT_CHARS = 4096
MAX_MODEL_LEN = 256
PROMPT = "Paged attention keeps the KV cache in blocks; héllo wörld 🙂"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "look", "arguments": '{"q": "fox"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a fox"}]
TOOLS = [{"type": "function", "function": {"name": "look", "description": "Look it up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def http(served_checkpoint):
    """A client of the HTTP API of a cluster of its own."""
    port = free_port()
    with (FakeCluster(served_checkpoint, step_ms=5,
                      sections={"gateway": {"http_port": port, "max_prompt_chars": MAX_PROMPT_CHARS},
                                "worker": {"max_model_len": MAX_MODEL_LEN}}),
          httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client):
        yield client


@pytest.fixture(scope="module")
def hf(served_checkpoint):
    return AutoTokenizer.from_pretrained(served_checkpoint)


def test_a_prompt_tokenizes_as_transformers_does_and_as_a_completion_sends_it(http, hf):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == hf.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == hf.convert_ids_to_tokens(body["tokens"])
    plain = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["tokens"] == hf.encode(PROMPT, add_special_tokens=False) and "token_strs" not in plain
    sent = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                                              "return_token_ids": True}).json()
    assert sent["choices"][0]["prompt_token_ids"] == body["tokens"]


def test_a_chat_tokenizes_as_its_template_renders_it_and_as_a_chat_request_sends_it(http, hf):
    body = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS}).json()
    # The test tokenizer's template renders no calls: the gateway writes them into the content.
    rendered = [{"role": m["role"], "content": m["content"] or '[{"name": "look", "arguments": {"q": "fox"}}]'}
                for m in MESSAGES]
    assert body["tokens"] == hf.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
    sent = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                                   "tool_choice": "none", "max_tokens": 1,
                                                   "return_token_ids": True}).json()
    assert sent["prompt_token_ids"] == body["tokens"]  # a chat's, as vLLM's, beside its choices
    assert sent["usage"]["prompt_tokens"] == body["count"]


def test_a_chat_without_its_generation_prompt_or_continuing_its_last_message_is_transformers(http, hf):
    messages = [{"role": "user", "content": "Once upon"}, {"role": "assistant", "content": "a time there"}]
    for flags in ({"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True}):
        body = http.post("/tokenize", json={"messages": messages, **flags}).json()
        assert body["tokens"] == hf.apply_chat_template(messages, tokenize=True, return_dict=False, **flags), flags
    sent = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1,
                                                   "add_generation_prompt": False, "continue_final_message": True,
                                                   "return_token_ids": True}).json()
    assert sent["prompt_token_ids"] == body["tokens"]
    assert hf.decode(body["tokens"]).endswith("a time there")  # its turn left open: no end-of-turn after it


def test_detokenize_is_transformers_decode_and_inverts_tokenize(http, hf):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r = http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": hf.decode(ids, skip_special_tokens=True)}
    assert r.json()["prompt"] == PROMPT
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path,body,status,named", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400,
     "unrecognized request argument: prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "tools": TOOLS}, 400, "tools"),
    ("/tokenize", {"prompt": "a" * (MAX_PROMPT_CHARS + 1)}, 400, "gateway.max_prompt_chars"),
    ("/tokenize", {"prompt": "日本" * (MAX_PROMPT_CHARS // 2)}, 400, "more than the model's context of 256"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a" * (MAX_PROMPT_CHARS + 1)}]}, 400,
     "gateway.max_prompt_chars"),
    ("/tokenize", {"messages": [{"role": "critic", "content": "x"}]}, 400, "messages.0.role"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "give its tool_call_id"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}}, 400,
     "cannot set the template's own tools"),
    ("/tokenize", {"prompt": "a", "temperature": 0}, 400, "temperature"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "other"),
    ("/detokenize", {"tokens": [5, 320]}, 400, "tokens.1"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/detokenize", {"model": "other", "tokens": [5]}, 404, "other"),
])
def test_bad_input_is_named(http, path, body, status, named):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert named in error["message"] or named == error["param"], error
    assert http.post("/tokenize", json={"prompt": "still served"}).status_code == 200
