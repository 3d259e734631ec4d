"""What a model decides, read out of its text, through the real cluster with the official client:
tool_choice "auto" (the calls it writes in its own format, Hermes' <tool_call> tags here, come
back as tool_calls, whole and streamed, on the chat and Responses APIs; text around them is the
content, an answer without calls is untouched, the tool loop's next turn reads the result), and a
reasoning model's thinking (<think>...</think>) answered apart as `reasoning`.

The model is bench/copy_checkpoint.py's copying Llama (it repeats its prompt's last PERIOD tokens)
under a Qwen3-style chat template (tools, <tool_call>, </think>), so each test decides what the
model "chooses" to write: the last message's text, padded with newlines to fill the period, then
the template's end of turn.
"""
from __future__ import annotations

import json

import httpx2 as httpx
import openai
import pytest

from bench.cluster_process import free_port
from bench.copy_checkpoint import make_copy_checkpoint
from cluster_harness import Cluster
from gateway.openai_requests import chat_request
from gateway.openai_schema import ChatCompletionRequest
from gateway.tokenizer import Tokenizer
from shared.config import GatewayConfig
from tokenizer_fixture import make_tokenizer

pytestmark = pytest.mark.timeout(300)
PERIOD = 224
MODEL = "hermes"
HERMES_TEMPLATE = (
    "{%- if reasoning_effort is defined %}<|effort|>{{ reasoning_effort }}{{ eos_token }}{% endif %}"
    "{%- if tools %}<|system|>You may call these functions: <tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools> To call one, answer <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.{{ eos_token }}"
    "{% endif %}{%- for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['reasoning_content'] %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_copy_checkpoint(tmp_path_factory.mktemp("auto") / MODEL, period=PERIOD, vocab_size=320,
                                max_position_embeddings=1024)
    # The tags are special tokens, as in Hermes 2 Pro's vocabulary: left out of the text unless the
    # server writes special tokens out for the parser.
    return make_tokenizer(path, vocab_size=320, chat_template=HERMES_TEMPLATE,
                          more_special_tokens=("<tool_call>", "</tool_call>"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def cluster(model_dir):
    with Cluster(model_dir, num_workers=1, sections={"gateway": {"http_port": free_port()}}) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="x", max_retries=0,
                       timeout=60) as c:
        yield c


def written(tokenizer, messages: list[dict], text: str, tools=(WEATHER,)) -> list[dict]:
    """`messages` with `text` as the last one's content, padded so that the model writes exactly `text`."""
    *earlier, last = messages
    for pad in range(PERIOD):
        content = "\n" * pad + text
        ids = tokenizer.encode_chat(earlier + [{**last, "content": content}], tools=list(tools))
        if tokenizer.decode(ids[-PERIOD:], skip_special_tokens=False) == content + "</s><|assistant|>":
            return earlier + [{**last, "content": content}]
    raise AssertionError(f"{text!r} does not fit the period")


def ask(tokenizer, text: str, **fields) -> dict:
    messages = written(tokenizer, [{"role": "user", "content": ""}], text)
    return {"model": MODEL, "messages": messages, "tools": [WEATHER], "temperature": 0.0, **fields}


def streamed(client, body: dict) -> tuple[str | None, list[dict], str]:
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for call in choice.delta.tool_calls or []:
                calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def test_a_call_the_model_writes_is_answered_as_tool_calls(client, tokenizer):
    r = client.chat.completions.create(**ask(tokenizer, CALL))
    [choice] = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})

    content, calls, finish = streamed(client, ask(tokenizer, CALL))
    assert (content, finish) == (None, "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    # Its tags are special tokens written out for the parser: each generated token has its logprob entry.
    r = client.chat.completions.create(**ask(tokenizer, CALL), logprobs=True)
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert {"<tool_call>", "</tool_call>"} <= {e.token for e in r.choices[0].logprobs.content}
    # The client's stream helper reports the call's arguments done, parsed.
    with client.chat.completions.stream(**ask(tokenizer, CALL)) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


def test_text_around_calls_is_the_content_and_text_alone_is_untouched(client, tokenizer):
    r = client.chat.completions.create(**ask(tokenizer, "Checking.\n" + CALL))
    message = r.choices[0].message
    assert message.content.strip("\n") == "Checking." and len(message.tool_calls) == 1
    assert streamed(client, ask(tokenizer, "Checking.\n" + CALL))[0] == message.content

    text = "The quick brown fox <tool jumps."
    r = client.chat.completions.create(**ask(tokenizer, text))
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.strip("\n") == text
    content, calls, finish = streamed(client, ask(tokenizer, text))
    assert (content, calls, finish) == (r.choices[0].message.content, [], "stop")

    broken = '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>'  # not a call: left as written
    r = client.chat.completions.create(**ask(tokenizer, broken))
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content.strip("\n") == broken


def test_parallel_calls_and_parallel_tool_calls_false(client, tokenizer):
    two = CALL + "\n" + CALL.replace("Paris", "Oslo")
    r = client.chat.completions.create(**ask(tokenizer, two))
    assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == ["Paris", "Oslo"]
    assert len({c.id for c in r.choices[0].message.tool_calls}) == 2
    content, calls, finish = streamed(client, ask(tokenizer, two))
    assert [json.loads(c["arguments"])["city"] for c in calls] == ["Paris", "Oslo"] and finish == "tool_calls"
    # At most one call where the client asks for no parallel calls (OpenAI's parallel_tool_calls).
    r = client.chat.completions.create(**ask(tokenizer, two, parallel_tool_calls=False))
    assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == ["Paris"]
    assert [json.loads(c["arguments"])["city"] for c in streamed(client, ask(tokenizer, two,
                                                                            parallel_tool_calls=False))[1]] == ["Paris"]


def test_the_tool_loop_sends_the_call_back_and_the_model_reads_the_result(client, tokenizer):
    first = client.chat.completions.create(**ask(tokenizer, CALL)).choices[0].message
    history = [{"role": "user", "content": "Weather in Paris?"}, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": ""}]
    messages = written(tokenizer, history, "Sunny, 21 C.")
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0.0)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content.strip("\n") == "Sunny, 21 C."


def test_the_responses_api_answers_function_call_items(client, tokenizer):
    def items(text: str, stream: bool):
        [message] = written(tokenizer, [{"role": "user", "content": ""}], text)
        body = dict(model=MODEL, input=message["content"], temperature=0.0,
                    tools=[{"type": "function", **WEATHER["function"]}])
        if not stream:
            return client.responses.create(**body)
        with client.responses.stream(**body) as s:
            events = [e.type for e in s]
            response = s.get_final_response()
        assert "response.function_call_arguments.done" in events
        return response

    for stream in (False, True):
        r = items(CALL, stream)
        [call] = r.output
        assert call.type == "function_call" and r.status == "completed"
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
        r = items("On it.\n" + CALL, stream)
        assert [o.type for o in r.output] == ["message", "function_call"]
        assert r.output[0].content[0].text.strip("\n") == "On it."
    # Sent back, the text and the call of that turn are one assistant message, as the model wrote them.
    follow = client.responses.create(model=MODEL, max_output_tokens=1, input=[
        {"role": "user", "content": "Weather?"}, *[o.model_dump(exclude_none=True) for o in r.output],
        {"type": "function_call_output", "call_id": r.output[1].call_id, "output": "sunny"}])
    call = {"id": r.output[1].call_id, "type": "function",
            "function": {"name": r.output[1].name, "arguments": r.output[1].arguments}}
    chat = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": r.output[0].content[0].text, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}])
    assert follow.usage.input_tokens == chat.usage.prompt_tokens


def test_auto_is_read_only_where_the_model_decides():
    def chat(parser, **fields):
        body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                     "tools": [WEATHER], **fields})
        return chat_request(body, GatewayConfig(), parser)

    request, presentation = chat("hermes")
    assert presentation.tool_parser == "hermes" and not request.sampling.HasField("structured_output")
    assert request.sampling.skip_special_tokens is False  # tags that are special tokens stay in the text
    assert chat("hermes", tool_choice="auto")[1].tool_parser == "hermes"
    # A constrained answer is that answer; "none" and "required" are not read for calls.
    assert chat("hermes", response_format={"type": "json_object"})[1].tool_parser == ""
    assert chat("hermes", tool_choice="none")[1].tool_parser == ""
    assert chat("hermes", tool_choice="required")[1].tool_parser == ""


THOUGHT = "<think>The user wants Paris.</think>\n\n"


def test_thinking_is_answered_apart_as_reasoning(client, tokenizer):
    r = client.chat.completions.create(**ask(tokenizer, THOUGHT + "It is sunny."),
                                       extra_body={"return_token_ids": True})
    message = r.choices[0].message
    assert message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    assert message.reasoning == message.reasoning_content == "The user wants Paris."
    # The thinking's tokens, counted as OpenAI counts them: those up to the end of </think>.
    ids = r.choices[0].token_ids
    thought = next(k for k in range(len(ids) + 1) if "</think>" in tokenizer.decode(ids[:k], skip_special_tokens=False))
    assert 0 < r.usage.completion_tokens_details.reasoning_tokens == thought < r.usage.completion_tokens
    plain = client.chat.completions.create(**ask(tokenizer, "It is sunny."))
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    # Thinking, then a call: each where it belongs.
    r = client.chat.completions.create(**ask(tokenizer, THOUGHT + CALL))
    message = r.choices[0].message
    assert (message.content, message.reasoning, r.choices[0].finish_reason) == (
        None, "The user wants Paris.", "tool_calls")
    assert message.tool_calls[0].function.name == "get_weather"

    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**ask(tokenizer, THOUGHT + "It is sunny."), stream=True):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("The user wants Paris.", "It is sunny.")

    # A constrained answer is that answer: nothing of it is read as thinking.
    r = client.chat.completions.create(**ask(tokenizer, THOUGHT + "x", response_format={"type": "json_object"},
                                             max_tokens=4))
    assert getattr(r.choices[0].message, "reasoning", None) is None


def test_thinking_goes_back_to_the_template_and_out_as_a_responses_item(client, tokenizer, cluster):
    rendered = httpx.post(f"http://127.0.0.1:{cluster.http_port}/tokenize", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Weather?"},
                                     {"role": "assistant", "content": "Sunny.", "reasoning": "Easy."}]}).json()
    assert "<|assistant|><think>Easy.</think>Sunny." in tokenizer.decode(rendered["tokens"], skip_special_tokens=False)

    [message] = written(tokenizer, [{"role": "user", "content": ""}], THOUGHT + "On it.\n" + CALL)
    body = dict(model=MODEL, input=message["content"], temperature=0.0,
                tools=[{"type": "function", **WEATHER["function"]}])
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as s:
        events = [(e.type, getattr(e, "output_index", None)) for e in s]
        streamed = s.get_final_response()
    assert ("response.reasoning_text.delta", 0) in events and ("response.content_part.added", 0) in events
    # The thinking's item is done before the message's is added, as OpenAI sends one item at a time.
    assert events.index(("response.output_item.done", 0)) < events.index(("response.output_item.added", 1))
    for r in (whole, streamed):
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
        assert r.output[0].content[0].text == "The user wants Paris."
        assert r.output[1].content[0].text == "On it."
    # Thinking and nothing after it: the reasoning item alone, no empty message.
    [message] = written(tokenizer, [{"role": "user", "content": ""}], THOUGHT.rstrip())
    body["input"] = message["content"]
    assert [o.type for o in client.responses.create(**body).output] == ["reasoning"]
    with client.responses.stream(**body) as s:
        assert [o.type for o in s.get_final_response().output] == ["reasoning"]
    # The next turn sends the items back, thinking included: taken, and given to the template.
    follow = client.responses.create(model=MODEL, temperature=0.0, max_output_tokens=2, input=[
        {"role": "user", "content": "Weather?"}, *[o.model_dump(exclude_none=True) for o in whole.output],
        {"type": "function_call_output", "call_id": whole.output[2].call_id, "output": "sunny"}])
    assert follow.status in ("completed", "incomplete")


def test_reasoning_effort_reaches_the_template(client, tokenizer):
    def prompt(extra: dict | None = None, **fields) -> str:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                           extra_body={"return_token_ids": True, **(extra or {})}, **fields)
        return tokenizer.decode(r.prompt_token_ids, skip_special_tokens=False)

    assert "<|effort|>" not in prompt()
    assert prompt(reasoning_effort="high").startswith("<|effort|>high</s>")
    # The client's own template variable wins.
    assert prompt({"chat_template_kwargs": {"reasoning_effort": "low"}}, reasoning_effort="high").startswith(
        "<|effort|>low</s>")
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1,
                                reasoning={"effort": "high", "summary": "auto"})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          reasoning_effort="high")
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert r.usage.input_tokens == chat.usage.prompt_tokens > plain.usage.prompt_tokens
