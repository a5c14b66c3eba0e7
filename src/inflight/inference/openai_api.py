"""OpenAI-compatible wire schemas (/v1/completions, /v1/chat/completions) and their mapping to the engine.

Only what a sampler can honour is accepted: a field the engine cannot serve (streaming, penalties, top
alternatives beyond the sampled token, tools) is rejected with a message instead of being ignored. vLLM's
extensions `top_k`, `stop_token_ids` and `ignore_eos` are accepted (the openai client sends them through
`extra_body`). Choices carry `token_ids`, `versions` and `prompt_token_ids` besides the OpenAI fields, so
agent code that speaks OpenAI still gets token-in/token-out data.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from inflight.inference.wire import SEED_MAX, Seed, StopString, StopStrings, Temperature, TokenId, TopP
from inflight.types import Completion, SamplingParams, new_id

MAX_N = 64  # samples per prompt in one request


class _SamplingFields(BaseModel):
    # Unknown fields (user, metadata, store, ...) are ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: Seed | None = None  # sample i of n uses seed + i, an int64 too
    stop: StopString | StopStrings | None = None
    stream: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    top_k: int = Field(default=0, ge=-1)  # vLLM extension; 0 or -1 = off
    stop_token_ids: list[TokenId] = Field(default_factory=list)  # vLLM extension
    ignore_eos: bool = False  # vLLM extension: do not stop at the end-of-sequence token(s)

    @model_validator(mode="after")
    def _reject_unsupported(self) -> _SamplingFields:
        if self.stream:
            raise ValueError("stream=true is not supported by this server; send stream=false")
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise ValueError("presence_penalty, frequency_penalty and logit_bias are not supported")
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            raise ValueError(
                f"seed={self.seed} with n={self.n}: sample i uses seed + i, which must stay <= {SEED_MAX} "
                f"(an int64); send seed <= {SEED_MAX - self.n + 1}"
            )
        return self

    def sampling_params(self, max_tokens: int, end_token_ids: list[int], index: int) -> SamplingParams:
        """Params of sample `index` of n; stop ids: the request's, plus the end tokens unless ignore_eos."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        stop_ids = self.stop_token_ids + ([] if self.ignore_eos else end_token_ids)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=None if self.seed is None else self.seed + index,
            stop=tuple(s for s in stops if s),
            stop_token_ids=tuple(dict.fromkeys(stop_ids)),
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(default=16, ge=1)  # OpenAI's default for this route
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _reject_unsupported_completion(self) -> CompletionRequest:
        if self.logprobs is not None and self.logprobs > 1:
            raise ValueError(
                f"logprobs={self.logprobs}: only the sampled token's logprob is returned; ask for 0 or 1"
            )
        if self.echo or self.suffix is not None:
            raise ValueError("echo and suffix are not supported")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported (use n and rank the samples yourself)")
        # Only a list is walked for empty prompts: a text prompt, walked character by character on the event
        # loop, held every client 2.2 s for 20 MB.
        items = self.prompt if isinstance(self.prompt, list) else []
        if not self.prompt or any(isinstance(p, list | str) and not p for p in items):
            raise ValueError("prompt is empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [[int(x) for x in p]]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the chat template

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message with its content as one string (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            kinds = sorted({str(part.get("type")) for part in content} - {"text"})
            if kinds:
                raise ValueError(f"only text content parts are supported, got {kinds}")
            content = "".join(str(part.get("text", "")) for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # None: up to the engine's sequence length
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # vLLM extension

    @model_validator(mode="after")
    def _reject_unsupported_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs > 1:
            raise ValueError(
                f"top_logprobs={self.top_logprobs}: only the sampled token's logprob is returned; "
                "ask for 0 or 1"
            )
        if self.tools or self.response_format:
            raise ValueError("tools and response_format are not supported: parse tool calls from the text")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, completions: list[Completion]) -> Usage:
        # n samples of one prompt count the prompt n times, like OpenAI.
        prompt = sum(len(c.prompt_token_ids) for c in completions)
        generated = sum(len(c.token_ids) for c in completions)
        return cls(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str
    token_ids: list[int]  # extension: the generated ids
    versions: list[int]  # extension: policy version per generated token
    prompt_token_ids: list[int]  # extension


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{new_id()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str
    token_ids: list[int]  # extension
    versions: list[int]  # extension


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{new_id()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int]  # extension: the rendered chat prompt


def token_texts(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Each token decoded alone (a character split across byte-level tokens shows as U+FFFD, as in vLLM)."""
    return [str(tokenizer.decode([t])) for t in token_ids]


def completion_choice(index: int, c: Completion, logprobs: int | None, tokenizer: Any) -> CompletionChoice:
    lp = None
    if logprobs is not None:
        texts = token_texts(tokenizer, c.token_ids)
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        top = [{t: v} for t, v in zip(texts, c.logprobs, strict=True)] if logprobs else None
        lp = CompletionLogprobs(
            tokens=texts, token_logprobs=c.logprobs, top_logprobs=top, text_offset=offsets
        )
    return CompletionChoice(
        index=index,
        text=c.text or "",
        logprobs=lp,
        finish_reason=c.finish_reason,
        token_ids=c.token_ids,
        versions=c.versions,
        prompt_token_ids=c.prompt_token_ids,
    )


def chat_choice(index: int, c: Completion, request: ChatCompletionRequest, tokenizer: Any) -> ChatChoice:
    lp = None
    if request.logprobs:
        content = []
        for text, value in zip(token_texts(tokenizer, c.token_ids), c.logprobs, strict=True):
            sampled = TopLogprob(token=text, logprob=value, bytes=list(text.encode()))
            top = [sampled] if request.top_logprobs else []
            content.append(TokenLogprob(**sampled.model_dump(), top_logprobs=top))
        lp = ChoiceLogprobs(content=content)
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=c.text or ""),
        logprobs=lp,
        finish_reason=c.finish_reason,
        token_ids=c.token_ids,
        versions=c.versions,
    )


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error shape; the openai client raises it with `message` as the text."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
