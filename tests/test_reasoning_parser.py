"""gateway/reasoning_parser.py: a reasoning model's <think>...</think> told apart from its answer,
where the output opens it and where the prompt did, thinking cut off, answers without any, and the
same reading however the streamed text is split."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.reasoning_parser import ThinkReader, prompt_opens_thinking, reads_reasoning


def whole(text: str, thinking: bool = False) -> tuple[str, str]:
    return ThinkReader(thinking).read_all(text)


def streamed(pieces: list[str], thinking: bool = False) -> tuple[str, str]:
    reader, reasoning, content = ThinkReader(thinking), "", ""
    for piece in pieces + [None]:
        r, c = reader.finish() if piece is None else reader.feed(piece)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def test_thinking_the_output_opens_is_reasoning_and_the_rest_content():
    assert whole("<think>\nLet me see.\n</think>\n\nThe answer.") == ("\nLet me see.\n", "The answer.")
    assert whole("\n<think>a</think>b") == ("a", "b")


def test_thinking_the_prompt_opened_needs_no_opening_tag():
    assert whole("Let me see.</think>\n\nThe answer.", thinking=True) == ("Let me see.", "The answer.")
    assert whole("<think>again</think>x", thinking=True) == ("again", "x")  # a model that opens it anyway


def test_answers_without_thinking_are_untouched():
    for text in ["", "Plain answer.", "  spaced  ", "<thin", "a <think> in the middle </think>", "</think> early"]:
        assert whole(text) == ("", text)


def test_thinking_cut_off_is_all_reasoning():
    assert whole("<think>still going") == ("still going", "")
    assert whole("still going </thi", thinking=True) == ("still going </thi", "")
    assert whole("<think>done</think>\n\n") == ("done", "")


def test_streaming_gives_text_as_soon_as_it_is_certain():
    reader = ThinkReader()
    assert reader.feed("<thi") == ("", "")
    assert reader.feed("nk>Plan") == ("Plan", "")
    reader = ThinkReader()
    assert reader.feed("<think>Plan") == ("Plan", "")
    assert reader.feed(" more</th") == (" more", "")
    assert reader.feed("ink>\n") == ("", "")
    assert reader.feed("\nAnswer") == ("", "Answer")
    assert reader.feed(" goes on") == ("", " goes on")
    assert reader.finish() == ("", "")


TEXTS = ["<think>\nLet me see.\n</think>\n\nThe answer.", "Plain <think> answer.", "\n\n<think>x</th",
         "<think></think>Answer", "no thinking at all"]


@settings(max_examples=80, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=10), which=st.integers(0, len(TEXTS) - 1),
       thinking=st.booleans())
def test_streamed_in_any_pieces_reads_as_the_whole_does(cuts, which, thinking):
    text = TEXTS[which]
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])]
    assert streamed(pieces, thinking) == whole(text, thinking)


def test_the_setting_and_the_template_decide():
    qwen3 = "{%- if reasoning_content %}<think>\n{{ reasoning_content }}\n</think>{% endif %}"
    assert reads_reasoning("auto", qwen3) and not reads_reasoning("auto", "{{ m['content'] }}")
    assert not reads_reasoning("auto", None) and reads_reasoning("think", None) and not reads_reasoning("none", qwen3)
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
