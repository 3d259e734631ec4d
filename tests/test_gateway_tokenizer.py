"""The gateway's torch-free tokenizer agrees with transformers' AutoTokenizer; streaming text never
splits a character; stop strings cut the text where they start."""
from __future__ import annotations

import json

import pytest

from gateway.streams import RequestState
from gateway.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from shared.sampling_params import SamplingParams

TEXTS = ["Once upon a time", "héllo wörld — naïve café", "日本語のテキスト 🙂 ✓", "  leading spaces\nand lines"]


def test_encode_decode_and_chat_match_autotokenizer(tokenizer, served_checkpoint):
    from transformers import AutoTokenizer
    reference = AutoTokenizer.from_pretrained(served_checkpoint, local_files_only=True)
    for text in TEXTS:
        assert tokenizer.encode(text) == reference.encode(text)
        ids = reference.encode(text)
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert tokenizer.render_chat(messages) == reference.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)
    assert tokenizer.special.eos_ids == (reference.eos_token_id,)
    assert tokenizer.special.pad_id == reference.pad_token_id != reference.eos_token_id


def test_the_default_model_tokenizer_matches_autotokenizer():
    from pathlib import Path

    from transformers import AutoTokenizer
    folder = Path(__file__).resolve().parent.parent / "models" / "default"
    ours, reference = Tokenizer(folder), AutoTokenizer.from_pretrained(folder, local_files_only=True)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text)
    messages = [{"role": "user", "content": "What does len do?"}]
    assert ours.encode_chat(messages) == reference.apply_chat_template(messages, tokenize=True,
                                                                       add_generation_prompt=True, return_dict=False)
    assert ours.special.eos_ids[0] == reference.eos_token_id and ours.warnings == []
    # vLLM's add_special_tokens false (a completion's; omit_special_tokens on the wire): no BOS is added.
    from gateway.openai_requests import completion_requests
    from gateway.openai_schema import CompletionRequest
    from gateway.validation import encoded_prompt
    from shared.config import GatewayConfig
    for add in (True, False):
        [request], _ = completion_requests(CompletionRequest(model="m", prompt=TEXTS[0], add_special_tokens=add),
                                           GatewayConfig())
        assert encoded_prompt(request, ours) == reference.encode(TEXTS[0], add_special_tokens=add)
    assert reference.encode(TEXTS[0]) != reference.encode(TEXTS[0], add_special_tokens=False)  # it has a BOS
    from gateway.validation import InvalidRequest
    from protos import inference_pb2
    with pytest.raises(InvalidRequest, match="omit_special_tokens goes with prompt"):
        encoded_prompt(inference_pb2.GenerateRequest(prompt_token_ids=[5, 6], omit_special_tokens=True), ours)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_never_splits_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens here
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_detokenizer_starts_from_the_prompt_context(tokenizer):
    prompt, completion = tokenizer.encode("Once upon"), tokenizer.encode(" a time")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(detok.push([i]) for i in completion) + detok.flush()
    assert text == tokenizer.decode(prompt + completion)[len(tokenizer.decode(prompt)):]


def _stream(tokenizer, stop, ids, min_tokens=0):
    state = RequestState(request_id="r", internal_id="g-1", prompt_ids=[5],
                         params=SamplingParams(stop=stop, max_tokens=100, min_tokens=min_tokens), priority=0,
                         tokenizer=tokenizer)
    stopped = False
    for i in ids:
        stopped = state.on_tokens([i], 0.0)
        if stopped:
            break
    if not stopped:
        state.finish("length", 0.0)
    events = []
    while not state.events.empty():
        events.append(state.events.get_nowait())
    return "".join(e.text for e in events), events[-1].finish_reason


def test_stop_string_cuts_text_and_is_never_streamed_partially(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps")
    text, reason = _stream(tokenizer, ("brown",), ids)
    assert (text, reason) == ("The quick ", "stop")
    text, reason = _stream(tokenizer, ("absent",), ids)
    assert (text, reason) == ("The quick brown fox jumps", "length")


def test_stop_strings_wait_for_min_tokens(tokenizer):
    text = "ab ab ab ab ab ab"
    ids = tokenizer.encode(text)
    assert _stream(tokenizer, ("b",), ids) == ("a", "stop")
    # Before its min_tokens-th token a stop string is text like any other; from it on, it stops.
    first_b_after = next(n for n in range(len(ids) + 1) if tokenizer.decode(ids[:n]).count("b") >= 3)
    got, reason = _stream(tokenizer, ("b",), ids, min_tokens=first_b_after)
    assert reason == "stop" and got == tokenizer.decode(ids[:first_b_after]).rsplit("b", 1)[0]


def test_missing_eos_is_refused_clearly(tmp_path, served_checkpoint):
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((served_checkpoint / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("eos_token_id")
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>"}))
    with pytest.raises(TokenizerError, match="no EOS token"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "</s>"}))
    assert any("also an EOS token" in w for w in Tokenizer(tmp_path).warnings)
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("model", ["served", "default"])
def test_token_bytes_join_into_the_texts_bytes(tokenizer, model):
    tok = tokenizer if model == "served" else Tokenizer("models/default")
    for text in ["héllo wörld 日本語 ☃", " plain ascii", "\u00e9\u0301"]:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [tok.token_bytes(i) for i in ids]
        assert b"".join(pieces) == tok.decode(ids).encode()
        # Some token stands for part of a character, which its own decode cannot show.
        if model == "served" and text.startswith("h"):
            assert any(tok.decode([i]) == "\ufffd" for i in ids)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ raise_exception.__globals__ }}{{ raise_exception.__code__ }}",
    "{% set _ = messages.append({'role': 'user', 'content': 'injected'}) %}{{ messages | length }}",
])
def test_a_chat_template_cannot_reach_python_internals(served_checkpoint, tmp_path, template):
    """An unsafe attribute is undefined (empty where printed, an error where called) and a mutation
    of the messages is refused: the request gets a TokenizerError, never Python's internals."""
    import shutil
    folder = tmp_path / "model"
    shutil.copytree(served_checkpoint, folder)
    (folder / "chat_template.jinja").write_text(template)
    try:
        rendered = Tokenizer(folder).render_chat([{"role": "user", "content": "hi"}])
    except TokenizerError as e:
        assert "sandbox forbids" in str(e) or "failed to render" in str(e)
    else:
        assert rendered == ""


def test_chat_template_kwargs_reach_the_template_but_not_its_own_variables(served_checkpoint, tmp_path):
    """vLLM's chat_template_kwargs, as Qwen3's template reads enable_thinking."""
    import shutil

    from gateway.validation import InvalidRequest, encoded_prompt
    from protos import inference_pb2 as pb
    folder = tmp_path / "model"
    shutil.copytree(served_checkpoint, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    tok = Tokenizer(folder)

    def rendered(**fields) -> str:
        request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hello")], **fields)
        return tok.decode(encoded_prompt(request, tok), skip_special_tokens=False)

    assert rendered() == "hello"
    assert rendered(chat_template_kwargs_json='{"enable_thinking": false}') == "hello<think></think>"
    for text, named in (('{"messages": []}', "cannot set the template's own messages"),
                        ('{"bos_token": "x", "tools": []}', "own bos_token, tools"),
                        ('[1]', "must be a JSON object"), ('{"a": ', "chat_template_kwargs")):
        with pytest.raises(InvalidRequest, match=named):
            rendered(chat_template_kwargs_json=text)
    with pytest.raises(InvalidRequest, match="goes with messages"):
        encoded_prompt(pb.GenerateRequest(prompt="hi", chat_template_kwargs_json='{"a": 1}'), tok)
