"""JSON a client sends nested deeper than Python follows, refused naming the field instead of
failing as an internal error.

Python's json module (and every walk over the parsed value) recurses once per level of arrays and
objects, so a few kilobytes of brackets raise RecursionError, which no caller expects. `loads`
parses a request's JSON text (a schema, tools, tool calls) into an error that names its field;
`deep_path` finds, in an HTTP body that could not be parsed or converted, where it nests too deeply.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable

# Deeper than any JSON a request needs (llguidance itself refuses a schema nested past 128 levels)
# and far below Python's recursion limit: where a body that failed is first this deep is where it
# nests too deeply.
DEEP = 128

# A string (with the colon after it when it is a key), or a bracket or comma outside strings.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"\s*(:)?|[\[\]{},]', re.S)


def too_deep(where: str) -> str:
    return f"{where} nests too deeply: its arrays and objects go deeper than the gateway parses"


def loads(text: str, where: str, error: Callable[[str], Exception]) -> Any:
    """`text` parsed; `error(message)` raised, the message naming `where`, when it is not JSON or
    nests too deeply."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where} is not valid JSON: {e}") from None
    except RecursionError:
        raise error(too_deep(where)) from None


def deep_path(body: bytes, depth: int = DEEP) -> list[str | int]:
    """The keys and indices down to the first array or object of JSON text `body` nested `depth`
    levels deep ([] when none is). Reads tokens, never recursing, and stops there."""
    frames: list[list] = []  # per open array or object: [is_array, the key or index now inside it]
    for token in _TOKEN.finditer(body):
        first = token[0][:1]
        if first in b"[{":
            if len(frames) == depth:
                return [label for _, label in frames]
            frames.append([first == b"[", 0 if first == b"[" else ""])
        elif first in b"]}":
            if frames:
                frames.pop()
        elif first == b",":
            if frames and frames[-1][0]:
                frames[-1][1] += 1
        elif token[1] and frames and not frames[-1][0]:  # a key: escapes are left as written
            frames[-1][1] = token[0][1:token[0].rindex(b'"')].decode("utf-8", "replace")
    return []
