"""OpenAI's Responses API, the answer half: a chat's one choice as a `response` object, and its
stream as the Responses API's typed events (`event: <type>` then its JSON, each with a
`sequence_number`), in the order OpenAI sends them.

Text streams as `response.output_text.delta` events of one message item. Tool calls leave whole
at the end: those of `tool_choice` "required" or a named function once the constrained output
parses, those the model chose (`"auto"`) as its tool-call format reads them (gateway/tool_parsers.py,
the message then holding only the text around them); each a `function_call` item after the message,
its arguments in one delta. A response cut by max_output_tokens is `incomplete`, reason
`max_output_tokens`, and one aborted `cancelled` (streamed, each ends with `response.incomplete`);
an error mid-stream is an `error` event, after which nothing follows.
"""
from __future__ import annotations

import json
import time
import uuid

from gateway.openai_requests import Presentation
from gateway.openai_responses import Choice, ResponseBuilder
from gateway.token_texts import TokenTexts
from gateway.responses_requests import ResponsesRequest
from shared.wire import TokenLogprob


# A generation's finish reason as a response's status: cut by its length, or ended by an abort.
_STATUS = {"length": "incomplete", "abort": "cancelled"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesBuilder:
    """The response object and stream events of one Responses request (one choice)."""
    carries_tokens = False

    def __init__(self, request_id: str, body: ResponsesRequest, model: str, presentation: Presentation,
                 texts: TokenTexts):
        self.body, self.model, self.presentation = body, model, presentation
        self.chat = ResponseBuilder(request_id, model, True, presentation, texts)  # its tool-call parsing
        self.id, self.message_id, self.reasoning_id = request_id, _id("msg"), _id("rs")
        self.created = int(time.time())
        self._sequence = 0
        self._opened = False  # the message item's added events are sent
        self._message_index = 0  # its output_index: 1 after a reasoning item
        self._reading = presentation.tool_parser or presentation.reasoning  # the text is read as it streams
        # Streamed and read: the content, calls and thinking so far (the thinking's item is open).
        self._text, self._calls, self._reasoning = "", [], None
        self._thinking_open = False  # the reasoning item is added and not yet done

    # ---- whole responses ----------------------------------------------------------------------------
    def response(self, choices: list[Choice]) -> dict:
        [c] = choices
        return self._response(c, self._output(c, *self.chat.answer(c)))

    def _response(self, c: Choice | None, output: list[dict]) -> dict:
        b = self.body
        status = "in_progress" if c is None or c.finish_reason is None else _STATUS.get(c.finish_reason, "completed")
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {
            "type": "text"}
        tool_choice = b.tool_choice.model_dump() if hasattr(b.tool_choice, "model_dump") else (b.tool_choice or "auto")
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "metadata": b.metadata or {}, "parallel_tool_calls": b.parallel_tool_calls is not False,
                "temperature": b.temperature, "top_p": b.top_p, "tool_choice": tool_choice,
                "tools": [t.model_dump(exclude_none=True) for t in b.tools or []], "text": {"format": fmt},
                "truncation": "disabled", "store": False, "user": b.user, "usage": None}
        if c is not None and c.finish_reason is not None:
            prompt, output_tokens = len(c.state.prompt_ids), len(c.state.output_ids)
            body["usage"] = {"input_tokens": prompt,
                             "input_tokens_details": {"cached_tokens": c.state.num_cached_tokens},
                             "output_tokens": output_tokens,
                             "output_tokens_details": {"reasoning_tokens": self.chat.reasoning_tokens(c)},
                             "total_tokens": prompt + output_tokens}
        return body

    def _output(self, c: Choice, content: str | None, calls: list[dict] | None,
                reasoning: str | None = None) -> list[dict]:
        """The thinking (where there is any), the message (where there is text, or no call) and then
        the calls."""
        status = "completed" if _STATUS.get(c.finish_reason, "completed") == "completed" else "incomplete"
        # Thinking that an answer followed was complete, whatever cut the answer.
        thinking = ([self._reasoning_item(reasoning, "completed" if content or calls else status)] if reasoning
                    else [])
        # No message where nothing but thinking was written (cut off, or the model stopped there).
        message = [self._message(content or "", status)] if content or not (calls or reasoning) else []
        return thinking + message + [self._call_item(call) for call in calls or []]

    def _reasoning_item(self, text: str | None, status: str) -> dict:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "status": status,
                "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}

    def _message(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [self._part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def _call_item(call: dict) -> dict:
        return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
                "arguments": call["function"]["arguments"], "status": "completed"}

    # ---- streamed events ----------------------------------------------------------------------------
    def opening(self, choices: list[Choice]) -> list[str]:
        events = [self._event("response.created", response=self._response(None, [])),
                  self._event("response.in_progress", response=self._response(None, []))]
        return events + ([] if self.presentation.tool_calls or self._reading else self._message_begun())

    def _message_begun(self) -> list[str]:
        """The answer's message item (the only item of a text answer) and its one text part, opened."""
        self._opened = True
        self._message_index = 0 if self._reasoning is None else 1
        return [self._event("response.output_item.added", output_index=self._message_index,
                            item=self._message(None, "in_progress")),
                self._event("response.content_part.added", item_id=self.message_id, output_index=self._message_index,
                            content_index=0, part=self._part(""))]

    def delta(self, c: Choice, text: str, token_ids: list[int], logprobs: list[TokenLogprob]) -> str | None:
        events = []
        if self._reading:
            read = self.chat.read(c, text)
            text = read.content
            self._text += text
            self._calls += read.calls
            if read.reasoning:
                if self._reasoning is None:
                    self._reasoning, self._thinking_open = "", True
                    events += [self._event("response.output_item.added", output_index=0,
                                           item=self._reasoning_item(None, "in_progress")),
                               self._event("response.content_part.added", item_id=self.reasoning_id, output_index=0,
                                           content_index=0, part={"type": "reasoning_text", "text": ""})]
                self._reasoning += read.reasoning
                events.append(self._event("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=0,
                                          content_index=0, delta=read.reasoning))
            if self._thinking_open and (text or self._calls):  # the answer began: the thinking is done
                events += self._thinking_done(self._reasoning_item(self._reasoning, "completed"))
        if text and not self.presentation.tool_calls:
            if not self._opened:
                events += self._message_begun()
            events.append(self._event("response.output_text.delta", item_id=self.message_id,
                                      output_index=self._message_index, content_index=0, delta=text, logprobs=[]))
        if c.finish_reason is not None:
            events += self._ending(c)
        return "".join(events) or None

    def _ending(self, c: Choice) -> list[str]:
        if self._reading:
            output = self._output(c, self._text, self._calls, self._reasoning)
        else:
            output = self._output(c, *self.chat.answer(c))
        events = []
        for index, item in enumerate(output):
            if item["type"] == "reasoning":
                if self._thinking_open:
                    events += self._thinking_done(item)
                continue
            if item["type"] == "message":
                text = item["content"][0]["text"]
                if not self._opened:  # calls that did not parse: the text, whole (or an empty answer)
                    events += self._message_begun()
                    if text:
                        events.append(self._event("response.output_text.delta", item_id=item["id"],
                                                  output_index=index, content_index=0, delta=text, logprobs=[]))
                events += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                       content_index=0, text=text, logprobs=[]),
                           self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                       content_index=0, part=self._part(text))]
            else:
                added = {**item, "arguments": "", "status": "in_progress"}
                events += [self._event("response.output_item.added", output_index=index, item=added),
                           self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=index, delta=item["arguments"]),
                           self._event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, name=item["name"], arguments=item["arguments"])]
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        response = self._response(c, output)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return events + [self._event(kind, response=response)]

    def _thinking_done(self, item: dict) -> list[str]:
        """The reasoning item's end: its text, its one part and the item, done (it is output 0)."""
        self._thinking_open = False
        return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=0, content_index=0,
                            text=self._reasoning),
                self._event("response.content_part.done", item_id=item["id"], output_index=0, content_index=0,
                            part=item["content"][0]),
                self._event("response.output_item.done", output_index=0, item=item)]

    def closing(self, choices: list[Choice]) -> list[str]:
        return []  # the completed (or incomplete) event ended the stream: there is no [DONE]

    def failure(self, error: dict) -> str:
        e = error["error"]
        return self._event("error", code=e["code"], message=e["message"], param=e["param"])

    def _event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
