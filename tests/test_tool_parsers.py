"""gateway/tool_parsers.py: Hermes' <tool_call> tags and Llama 3's JSON calls read out of a model's
text, whole and streamed in any pieces (the same content and calls however the text is split),
text without calls passed through unchanged, and calls that do not parse left in the content."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tool_parsers import Read, call_reader, parser_for

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
CLOCK = '{"name": "get_time", "arguments": {"zone": "UTC"}}'


def whole(parser: str, text: str) -> Read:
    return call_reader(parser).read_all(text)


def streamed(parser: str, pieces: list[str]) -> Read:
    reader, read = call_reader(parser), Read()
    for piece in pieces:
        read += reader.feed(piece)
    read += reader.finish()
    return read


def calls(read: Read) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in read.calls]


def test_hermes_reads_calls_and_the_text_around_them():
    read = whole("hermes", f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{CLOCK}\n</tool_call>\n")
    assert read.content == "Let me check."
    assert calls(read) == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "UTC"})]
    for call in read.calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
    assert len({c["id"] for c in read.calls}) == 2


def test_hermes_text_after_a_call_keeps_its_spaces_and_starts_a_line():
    text = f"Hello there <tool_call>{WEATHER}</tool_call> and then some text"
    assert whole("hermes", text).content == "Hello there\nand then some text"
    assert streamed("hermes", list(text)).content == "Hello there\nand then some text"
    after = f"<tool_call>{WEATHER}</tool_call>\nI will call it now."
    assert streamed("hermes", list(after)).content == whole("hermes", after).content == "I will call it now."


def test_hermes_passes_text_without_calls_through_unchanged():
    for text in ["", "plain", "  spaced out  \n\n", "a < b and <tool is not <tool_call", "ends with <tool_"]:
        read = whole("hermes", text)
        assert (read.content, read.calls) == (text, [])


def test_hermes_call_without_its_closing_tag_counts_where_its_json_is_whole():
    assert calls(whole("hermes", f"<tool_call>\n{WEATHER}\n")) == [("get_weather", {"city": "Paris", "unit": "c"})]
    cut = f"Sure <tool_call>\n{WEATHER[:30]}"
    read = whole("hermes", cut)
    assert (read.content, read.calls) == (cut, [])


def test_hermes_leaves_calls_that_do_not_parse_in_the_content():
    for body in ['{"name": "f", "arguments": [1]}', "not json", '{"arguments": {}}', '{"name": ""}']:
        text = f"A <tool_call>{body}</tool_call> B"
        read = whole("hermes", text)
        assert read.calls == [] and read.content == text


def test_hermes_takes_arguments_written_as_json_text():
    read = whole("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert calls(read) == [("f", {"x": 1})]


def test_llama3_json_reads_one_or_several_calls():
    one = whole("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert calls(one) == [("get_weather", {"city": "Oslo"})] and one.content == ""
    two = whole("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 2}}')
    assert calls(two) == [("a", {}), ("b", {"k": 2})]


def test_llama3_json_text_and_json_that_is_no_call_are_content():
    for text in ["The answer is {1}.", '{"answer": 42}', '{"name": "a", "parameters": {}} trailing', "{broken",
                 '{"name": "Alice", "age": 30}']:
        read = whole("llama3_json", text)
        assert (read.content, read.calls) == (text, [])


def test_llama3_json_streams_text_as_it_comes_and_holds_json():
    reader = call_reader("llama3_json")
    assert reader.feed("Hello").content == "Hello"
    assert reader.feed(" there").content == " there"
    reader = call_reader("llama3_json")
    assert reader.feed('  {"name": "a", ').content == ""
    assert reader.feed('"parameters": {}}').content == ""
    assert calls(reader.finish()) == [("a", {})]


def test_hermes_streams_content_before_a_call_completes_and_each_call_once_whole():
    reader = call_reader("hermes")
    assert reader.feed("Checking the weather").content == "Checking the weather"
    assert reader.feed(" now.\n<tool").content == " now."  # the possible tag and the gap are held
    read = reader.feed(f"_call>\n{WEATHER[:20]}")
    assert (read.content, read.calls) == ("", [])
    read = reader.feed(f"{WEATHER[20:]}\n</tool_call>")
    assert calls(read) == [("get_weather", {"city": "Paris", "unit": "c"})] and read.content == ""
    assert reader.finish() == Read()


def _splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


ANSWERS = {
    "hermes": [f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{CLOCK}</tool_call>\n\n",
               "no calls at all, <tool_ and < spaces   ", f"<tool_call>{WEATHER}</tool_call> then text",
               "A <tool_call>{bad}</tool_call> B", f"\n\n<tool_call>\n{CLOCK}",
               f"Hi there <tool_call>{WEATHER}</tool_call> and then some <tool text"],
    "llama3_json": ['{"name": "a", "parameters": {"x": [1, 2]}}; {"name": "b", "parameters": {}}',
                    "  plain text {with braces}", "<|python_tag|>" + '{"name": "a", "parameters": {}}',
                    "<|python", '{"not": "a call"}'],
}


@pytest.mark.parametrize("parser", sorted(ANSWERS))
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=40), which=st.integers(0, 5))
def test_streamed_in_any_pieces_reads_as_the_whole_does(parser, cuts, which):
    text = ANSWERS[parser][which % len(ANSWERS[parser])]
    expected, got = whole(parser, text), streamed(parser, _splits(text, cuts))
    assert got.content == expected.content
    assert calls(got) == calls(expected)


def test_the_parser_follows_the_setting_or_what_the_template_teaches():
    qwen = "{%- if tools %}...<tools>{{ tool | tojson }}</tools>... within <tool_call></tool_call> XML tags"
    llama = "{%- if tools %}{{- '<|python_tag|>' + tool_call.name }}{{ '\"parameters\": ' }}"
    assert parser_for("auto", qwen) == "hermes"
    assert parser_for("auto", llama) == "llama3_json"
    assert parser_for("auto", "{% for m in messages %}{{ m['content'] }}{% endfor %}") is None
    assert parser_for("auto", None) is None
    assert parser_for("none", qwen) is None
    assert parser_for("llama3_json", qwen) == "llama3_json"
