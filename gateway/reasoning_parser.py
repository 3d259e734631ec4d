"""A reasoning model's thinking, told apart from its answer: the text between `<think>` and
`</think>` (Qwen3, QwQ, DeepSeek-R1 and its distills) is the answer's `reasoning`, as vLLM's
reasoning parsers answer it, and only what follows is its content.

Thinking starts where the output opens `<think>`, or where the prompt already did (templates that
end the generation prompt with `<think>`, such as DeepSeek-R1's, or Qwen3's with thinking on in its
later releases); a prompt that closed it (Qwen3 with `enable_thinking: false`) leaves none to read.
Thinking that never closes (cut by max_tokens) is all reasoning. Whitespace between `</think>` and
the answer is not content. Fed the text as it is generated, a `ThinkReader` gives each time the
reasoning and the content that are certain; fed everything, the whole answer's.
"""
from __future__ import annotations

from gateway.tool_parsers import tag_prefix_len

OPEN, CLOSE = "<think>", "</think>"


def reads_reasoning(setting: str, chat_template: str | None) -> bool:
    """Whether `gateway.reasoning_parser` reads thinking: "think" always, "auto" where the chat
    template knows `</think>`, "none" never."""
    if setting == "auto":
        return bool(chat_template) and CLOSE in chat_template
    return setting == "think"


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt (its last characters suffice) leaves a `<think>` open."""
    return prompt_tail.rstrip().endswith(OPEN)


class ThinkReader:
    def __init__(self, thinking: bool = False):
        # "start": the output may yet open <think>; "thinking"; "after": </think> seen, whitespace
        # to drop; "content".
        self._state = "thinking" if thinking else "start"
        self._pending = ""
        self._fresh = True  # nothing read in this thinking yet: a <think> here is the opening

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` makes certain."""
        if self._state == "content":
            return "", text
        self._pending += text
        reasoning, content = "", ""
        while True:
            if self._state == "start" or (self._state == "thinking" and self._fresh):
                head = self._pending.lstrip()
                if not head or (OPEN.startswith(head) and head != OPEN):
                    return reasoning, content  # could still be the opening tag
                if head.startswith(OPEN):
                    self._pending, self._state = head[len(OPEN):], "thinking"
                elif self._state == "start":
                    self._state = "content"
                    content, self._pending = self._pending, ""
                    return reasoning, content
                self._fresh = False
                continue
            if self._state == "thinking":
                end = self._pending.find(CLOSE)
                if end < 0:
                    held = tag_prefix_len(self._pending, CLOSE)
                    reasoning += self._pending[:len(self._pending) - held]
                    self._pending = self._pending[len(self._pending) - held:]
                    return reasoning, content
                reasoning += self._pending[:end]
                self._pending, self._state = self._pending[end + len(CLOSE):], "after"
                continue
            # "after": the answer starts at its first character that is not whitespace.
            head = self._pending.lstrip()
            if head:
                self._state, self._pending = "content", ""
                content += head
            else:
                self._pending = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        pending, self._pending = self._pending, ""
        if self._state == "thinking":
            return pending, ""
        if self._state == "start":
            return "", pending
        return "", ""

    def read_all(self, text: str) -> tuple[str, str]:
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return reasoning + more_reasoning, content + more_content
