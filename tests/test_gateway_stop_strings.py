"""Stop strings over text deltas: the text ends where the first stop string to complete begins, however
the stream is cut into deltas; only text that could begin a stop string is held back; and the work per
delta does not grow with the stream."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.stop_strings import StopMatcher


def run(stops: tuple[str, ...], deltas: list[str]) -> tuple[str, bool, list[int]]:
    """(text sent, whether a stop matched, characters held after each delta)."""
    matcher, sent, held = StopMatcher(stops), [], []
    for delta in deltas:
        text, stopped = matcher.push(delta)
        sent.append(text)
        held.append(len(matcher._held))
        if stopped:
            return "".join(sent), True, held
    return "".join(sent) + matcher.flush(), False, held


def test_holds_back_only_what_could_begin_a_stop_string():
    matcher = StopMatcher(("world", "STOP"))
    assert matcher.push("hello wor") == ("hello ", False)  # "wor" may become "world"
    assert matcher.push("k and ST") == ("work and ", False)
    assert matcher.push("OP here") == ("", True)
    # Text that cannot begin a stop string leaves at once (the old matcher held back 4 characters).
    assert StopMatcher(("world",)).push("abcdefgh") == ("abcdefgh", False)


def test_the_first_completed_stop_string_wins_however_the_text_is_cut():
    # "cd" is complete before "abcdef" is: generation would have stopped there.
    assert run(("cd", "abcdef"), ["xxab", "cdef"])[:2] == run(("cd", "abcdef"), ["xxabcdef"])[:2] == ("xxab", True)
    # Completed by the same character, the longer (earlier-starting) one wins.
    assert run(("bc", "abc"), ["a", "bc"])[:2] == run(("bc", "abc"), ["abc"])[:2] == ("", True)
    assert run(("zz",), ["a", "b"]) == ("ab", False, [0, 0])


def first_completed(text: str, stops: tuple[str, ...]) -> int | None:
    """The reference, over the whole text: the start of the stop string that ends first."""
    ends = [(i + len(s), i) for s in stops for i in range(len(text)) if text.startswith(s, i)]
    return min(ends)[1] if ends else None


def test_a_long_stream_holds_a_bounded_tail():
    stop = "a" * 255 + "b"
    _, stopped, held = run((stop, "xyz"), ["a"] * 20_000)
    assert not stopped and max(held) == 255  # never more than the longest stop string less one


text_alphabet = st.sampled_from(list("ab c\n") + ["é", "日", "🙂"])


@settings(max_examples=300, deadline=None)
@given(text=st.text(text_alphabet, max_size=60), stops=st.lists(st.text(text_alphabet, min_size=1, max_size=5),
                                                                  min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 60), max_size=12))
def test_any_cutting_into_deltas_sends_the_text_before_the_first_stop(text, stops, cuts):
    stops = tuple(stops)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    sent, stopped, held = run(stops, deltas)
    cut = first_completed(text, stops)
    assert (sent, stopped) == ((text, False) if cut is None else (text[:cut], True))
    assert all(h <= max(map(len, stops)) - 1 for h in held)
