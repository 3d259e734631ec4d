"""vLLM's /tokenize and /detokenize on the HTTP API: a prompt, or a chat's messages and tools,
turned into the token ids a completion or chat request with them would give the model (the same
checks, template and tokenizer), counted against the context (one longer than the context is
refused, naming its count: no request could send it); and token ids turned back into text.

Clients use them to budget a prompt before sending it and to see how text splits. Neither is a
generation: no request-log line, no queue, no key's request or token budget; each still needs a
valid key where keys are on, and a large input is tokenized on the gateway's pool threads.
"""
from __future__ import annotations

from typing import Annotated, Any, Callable, Union

from fastapi import FastAPI
from pydantic import BaseModel, Discriminator, Field, Tag, create_model

from gateway.admission import Admission
from gateway.http_errors import ApiError
from gateway.offload import OffloadBusyError, should_offload
from gateway.openai_requests import BadRequest, chat_request
from gateway.tool_schema import named_as_in_body
from gateway.openai_schema import ChatCompletionRequest, ChatMessage, Tool, _Request
from gateway.tokenizer import Tokenizer
from gateway.validation import InvalidRequest, check_sizes, encoded_prompt
from protos import inference_pb2

# Token ids decoded (or looked up) on the loop up to this many; more on a pool thread.
DETOKENIZE_ON_LOOP_MAX = 4096


class TokenizePromptRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (a BOS), as a completion "
                                                       "does.")
    return_token_strs: bool = Field(False, description="Also return each token's piece of the vocabulary.")


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, description="The tools the chat template renders.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="More variables the chat template reads.")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = Field(False, description="Also return each token's piece of the vocabulary.")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


def _tokenize_kind(body) -> str:
    return "TokenizeChatRequest" if isinstance(body, dict) and "messages" in body else "TokenizePromptRequest"


# A body with messages is a chat's, any other a prompt's: so a refusal names the fields of the body
# the client meant (the branch's tag is its class's name, which an error's location leaves out).
TokenizeRequest = Annotated[Union[Annotated[TokenizePromptRequest, Tag("TokenizePromptRequest")],
                                  Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")]],
                            Discriminator(_tokenize_kind)]


def detokenize_request(vocab_size: int) -> type[_Request]:
    """The /detokenize body of a vocabulary of `vocab_size` ids: the schema says which ids are valid."""
    return create_model("DetokenizeRequest", __base__=_Request, model=(str | None, None),
                        tokens=(list[Annotated[int, Field(ge=0, lt=vocab_size)]], ...))


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizeRoutes:
    def __init__(self, admission: Admission, check_model: Callable[[str], None], errors: dict):
        self.admission = admission
        self.tokenizer: Tokenizer = admission.tokenizer
        self.limits = admission.config.gateway
        self.check_model = check_model
        self.errors = errors

    def register(self, app: FastAPI) -> None:
        detokenize_body = detokenize_request(self.tokenizer.vocab_size)

        async def tokenize(body: TokenizeRequest) -> dict:
            return await self.tokenize(body)

        async def detokenize(body) -> dict:
            return await self.detokenize(body.model, body.tokens)
        detokenize.__annotations__["body"] = detokenize_body  # a class made here: no name to resolve

        app.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True,
                 responses=self.errors)(tokenize)
        app.post("/detokenize", response_model=DetokenizeResponse, responses=self.errors)(detokenize)

    async def tokenize(self, body: TokenizePromptRequest | TokenizeChatRequest) -> dict:
        if body.model is not None:
            self.check_model(body.model)
        prompt = isinstance(body, TokenizePromptRequest)
        request = inference_pb2.GenerateRequest(prompt=body.prompt) if prompt else self._chat_request(body)
        try:
            num_chars = check_sizes(request, self.limits)
            large = should_offload(num_chars, len(request.messages))
            if prompt:  # a completion's encoding, with or without the special tokens
                ids = await self._run(large, self.tokenizer.encode, body.prompt, body.add_special_tokens)
            else:
                ids = await self._run(large, encoded_prompt, request, self.tokenizer)
        except InvalidRequest as e:
            raise ApiError.from_code(e.code, named_as_in_body(e.message, "")) from None
        max_model_len = self.admission.max_model_len
        if len(ids) > max_model_len:  # no request could send it: its ids would only cost the loop to answer
            raise ApiError(400, f"the {'prompt' if prompt else 'chat'} is {len(ids)} tokens, more than the model's "
                                f"context of {max_model_len}", "prompt" if prompt else "messages")
        answer = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if body.return_token_strs:
            answer["token_strs"] = await self._run(len(ids) > DETOKENIZE_ON_LOOP_MAX, self._pieces, ids)
        return answer

    def _pieces(self, ids: list[int]) -> list[str | None]:
        return [self.tokenizer.token_piece(i) for i in ids]

    async def detokenize(self, model: str | None, tokens: list[int]) -> dict:
        if model is not None:
            self.check_model(model)
        return {"prompt": await self._run(len(tokens) > DETOKENIZE_ON_LOOP_MAX, self.tokenizer.decode, tokens)}

    def _chat_request(self, body: TokenizeChatRequest) -> inference_pb2.GenerateRequest:
        chat = ChatCompletionRequest(model=body.model or "", messages=body.messages, tools=body.tools,
                                     tool_choice="none", chat_template_kwargs=body.chat_template_kwargs,
                                     add_generation_prompt=body.add_generation_prompt,
                                     continue_final_message=body.continue_final_message)
        try:
            request, _ = chat_request(chat, self.limits)
        except BadRequest as e:
            raise ApiError(e.status, e.message, e.param, e.code) from None
        return request

    async def _run(self, large: bool, fn, *args):
        if not large:
            return fn(*args)
        try:
            return await self.admission.offload.run(fn, *args)
        except OffloadBusyError as e:
            raise ApiError(503, str(e), None, "overloaded") from None
