"""Stop strings over a stream of text deltas: where the text ends, and how much of it to hold back.

The text ends where the first stop string to be completed begins (of two completed by the same
character, the longer): generation stops there, so what follows never exists, and the answer does
not depend on how the stream was cut into deltas. A delta is searched together with the text held
back from earlier ones, and only text that
could still be the start of a stop string is held back (never more than the longest stop
string less one character). So each delta costs O((new text + longest stop) x number of stop
strings), whatever the length of the stream; the gateway bounds both factors at admission.
"""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...], keep_stop: bool = False):
        self.stops = stops
        self.keep_stop = keep_stop  # the text ends after the stop string (vLLM's include_stop_str_in_output)
        self._held = ""  # the stream's last characters: they may begin a stop string

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string matched). On a match the text ends where the
        first completed stop string begins (or, keeping it, ends), and the matcher is done."""
        if not self.stops:
            return text, False
        window = self._held + text
        cut = first_stop(window, self.stops, self.keep_stop)
        if cut is not None:
            self._held = ""
            return window[:cut], True
        keep_from = self._partial_match_start(window)
        self._held = window[keep_from:]
        return window[:keep_from], False

    def flush(self) -> str:
        """At the end of the stream: whatever was held back (it never became a stop string)."""
        held, self._held = self._held, ""
        return held

    def _partial_match_start(self, window: str) -> int:
        """The earliest position from which the rest of `window` is a proper prefix of a stop string."""
        start = len(window)
        for stop in self.stops:
            # Only the last len(stop) - 1 characters can begin a match that the next delta completes.
            i = window.find(stop[0], max(0, len(window) - len(stop) + 1), start)
            while i != -1:
                if stop.startswith(window[i:]):
                    start = i  # the earliest for this stop; later stops may only find earlier ones
                    break
                i = window.find(stop[0], i + 1, start)
        return start


def first_stop(text: str, stops: tuple[str, ...], end: bool = False) -> int | None:
    """Where the first stop string completed in `text` begins (the earliest end; at equal ends the
    earliest start), or with `end` where it ends; None where none is."""
    matches = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return min(matches)[0 if end else 1] if matches else None
