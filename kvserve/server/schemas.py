"""OpenAI request bodies. Unknown fields are ignored, as OpenAI-compatible servers do."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16
MAX_TOP_LOGPROBS = 20


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx body: OpenAI's error shape."""

    error: ErrorDetail


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class _Sampling(_Body):
    """Fields shared by chat and text completions."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: Union[str, list[str], None] = Field(None, validate_default=True)
    max_tokens: int | None = Field(None, ge=1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM's and llama-server's extension, for benchmarks
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: Union[str, list[str], None]) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError("logit_bias values must be between -100 and 100")
        return value


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    max_tokens: int | None = Field(16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Union[str, list[int], list[str]]) -> Union[str, list[int]]:
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("one prompt per request is supported")
            return value[0]
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        # Echoing the prompt (and its logprobs) is not implemented; ignoring the flag would answer
        # with a text the client does not expect.
        if value:
            raise ValueError("echo is not supported")
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens
