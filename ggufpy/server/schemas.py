"""Request bodies of the OpenAI-compatible API, as pydantic models: types and ranges are checked here, so a
wrong body is a 400 naming the field (`app.py` turns pydantic's errors into OpenAI's error object).

Unknown fields are accepted and ignored, as OpenAI-compatible servers do (clients send `user`, `store`, ...).
Sampling fields left out keep `SamplingParams`' defaults (llama.cpp's), not OpenAI's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 8  # choices per request: each is a slot's worth of work
# template variables the server sets itself (`ChatTemplate.render`'s arguments): not in chat_template_kwargs
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`; llama.cpp's `{"type": "json_object", "schema": {...}}` is accepted too."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class Sampling(_Body):
    """The fields chat and text completions share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_prompt: bool = True  # llama.cpp's field: reuse the KV of an earlier request's prompt prefix
    response_format: ResponseFormat | None = None
    grammar: str | None = None  # GBNF, as llama.cpp's server

    def grammar_spec(self) -> tuple[str, Any] | None:
        """(kind, source) of the output's grammar (`constrain.GRAMMARS`), or None for free text."""
        fmt = self.response_format
        if self.grammar and fmt is not None and fmt.type != "text":
            raise ValueError("grammar and response_format both constrain the output: send one of them")
        if self.grammar:
            return "gbnf", self.grammar
        if fmt is None or fmt.type == "text":
            return None
        schema = fmt.schema_ if fmt.json_schema is None else fmt.json_schema.schema_
        if fmt.type == "json_schema" and schema is None:
            raise ValueError("response_format.json_schema.schema: required for type json_schema")
        return ("json_object", None) if schema is None else ("json_schema", schema)

    def sampling_fields(self) -> dict[str, Any]:
        """The `SamplingParams` fields this body sets (logit_bias keys as token ids)."""
        names = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
        out = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.repetition_penalty is not None:
            out["repetition_penalty"] = self.repetition_penalty
        if self.logit_bias:
            out["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        return out

    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stop if s)


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = False  # llama.cpp's default: one forced call (OpenAI's is true)
    # template variables, as llama.cpp's server takes them: OpenAI's reasoning_effort (gpt-oss's "Reasoning: ..."),
    # and any others (Qwen 3's enable_thinking, gpt-oss's model_identity, builtin_tools)
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(value or ()) & RESERVED_TEMPLATE_VARIABLES)
        if taken:
            raise ValueError(f"sets {taken}: the server sets {sorted(RESERVED_TEMPLATE_VARIABLES)} itself")
        return value

    def template_variables(self) -> dict[str, Any]:
        """The chat template's extra variables this request sets."""
        effort = {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort}
        return {**(self.chat_template_kwargs or {}), **effort}


class CompletionRequest(Sampling):
    prompt: str | list[int] = Field(union_mode="left_to_right")
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] = Field(union_mode="left_to_right")
    encoding_format: Literal["float", "base64"] = "float"


class TokenizeRequest(_Body):
    content: str
    add_special: bool = False
    parse_special: bool = True


class DetokenizeRequest(_Body):
    tokens: list[int]
