"""OpenAI request bodies, and the base every API's bodies share. Unknown fields are ignored, as
OpenAI-compatible servers do."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, TypeAdapter, ValidationError, ValidationInfo,
    create_model, field_validator, model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from kvserve.tools.spec import NAME_PATTERN

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


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_takes_the_default(cls, data: Any) -> Any:
        """A field sent as null takes its default, as the OpenAI SDK's types allow (`temperature:
        Optional[float]`) and vLLM and llama-server read it; a required field stays null (a 400)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].is_required() or fields[key].default is None}


def _no_bool(value: object) -> object:
    """A duration is no bool: a float field would read `true` as 1 second."""
    if isinstance(value, bool):
        raise ValueError(f"{json.dumps(value)} is not a duration (seconds, or such as 5m, 1h30m, -1)")
    return value


# Ollama's keep_alive, how long the model stays loaded once idle: seconds, or a duration such as "5m"
# that catalog.keep_alive_seconds reads when the model is leased.
KeepAlive = Annotated[Union[float, str, None], BeforeValidator(_no_bool)]


def tagged(*kinds: tuple[type[Body], tuple[str | None, ...]], refusal: str,
           strings: str | None = None) -> Discriminator:
    """A discriminator on `type` whose tags are the models' names (which error params leave out)
    and whose error for any other type is `refusal`. A `None` type value stands for a missing type;
    a string value gets the tag `strings`."""
    tags = {value: model.__name__ for model, values in kinds for value in values}

    def tag(value: Any) -> str | None:
        if isinstance(value, str):
            return strings
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if kind is None or isinstance(kind, str) else None

    return Discriminator(tag, custom_error_type="unsupported_type", custom_error_message=refusal)


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"  # OpenAI sends JSON text; a few clients send the object

    @property
    def arguments_text(self) -> str:
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments, ensure_ascii=False)


class MessageToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    reasoning_content: str | None = None  # assistant messages: the thinking before the reply, if sent back

    @field_validator("tool_call_id")
    @classmethod
    def _id_given(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("tool_call_id must not be empty")
        return value

    @model_validator(mode="after")
    def _tool_fields(self) -> "Message":
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(Body):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (a chunk may carry several
    # tokens where a draft was verified)
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Body):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class FunctionDefinition(Body):
    name: str = Field(pattern=NAME_PATTERN.pattern)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments; none: no arguments
    strict: bool | None = None  # accepted; kvserve enforces every tool's schema by grammar


class ChatTool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(Body):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)


class AllowedToolsChoice(Body):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoiceField = Union[Literal["none", "auto", "required"], NamedToolChoice, AllowedToolsChoice]
_CHOICE_OBJECT: TypeAdapter = TypeAdapter(
    Annotated[Union[NamedToolChoice, AllowedToolsChoice], Field(discriminator="type")])


MAX_CACHE_SALT = 256  # characters of a `cache_salt`


def cache_salt_field() -> Any:
    """vLLM's `cache_salt`: requests share cached rows only with requests of the same salt (and tenant)."""
    return Field(None, min_length=1, max_length=MAX_CACHE_SALT,
                 description="requests share cached prompt rows only with requests that send the same salt")


MAX_LORA = 16  # entries of a request's `lora` list


class LoraScale(Body):
    """llama-server's per-request adapter: `id`, the adapter's index in `--lora` order, at `scale`."""

    id: int = Field(ge=0)
    scale: float = Field(1.0, allow_inf_nan=False)


# Other servers' parameters that change what is generated, which kvserve does not serve: a body that
# sets one to anything but its no-op value is refused, not answered as if it had not asked.
# Each: the values that ask for nothing, and what to send instead.
_UNSERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((None, ""), "there is no insertion (fill-in-the-middle) mode"),
    "best_of": ((None, 1), "send n, and choose among the choices"),
    "min_tokens": ((None, 0), "send ignore_eos to generate up to max_tokens"),
    "repetition_penalty": ((None, 1, 1.0), "send repeat_penalty (over the last 64 generated tokens)"),
    "n_predict": ((None, -1), "send max_tokens"),
    "grammar": ((None, ""), "send response_format or tools"),
    "json_schema": ((None,), "send response_format: {type: json_schema, json_schema: {name, schema}}"),
    "guided_json": ((None,), "send response_format: {type: json_schema, json_schema: {name, schema}}"),
    "guided_regex": ((None,), "send response_format with a string schema and its pattern"),
    "guided_choice": ((None,), "send response_format with an enum schema"),
    "guided_grammar": ((None,), "send response_format or tools"),
    "structured_outputs": ((None,), "send response_format or tools"),
    "typical_p": ((None, 1, 1.0), "send top_p, top_k or min_p"),
    "mirostat": ((None, 0), "send top_p, top_k or min_p"),
    "top_n_sigma": ((None, -1, -1.0), "send top_p, top_k or min_p"),
    "xtc_probability": ((None, 0, 0.0), "send top_p, top_k or min_p"),
    "dry_multiplier": ((None, 0, 0.0), "send repeat_penalty"),
    "use_beam_search": ((None, False), "there is no beam search"),
    "stop_token_ids": ((None, []), "send stop strings"),
    "include_stop_str_in_output": ((None, False), "a matched stop string is always left out of the text"),
    "skip_special_tokens": ((None, True), "special tokens are always left out of the text"),
    "prompt_logprobs": ((None, 0), "there are no prompt logprobs"),
    "truncate_prompt_tokens": ((None,), "send a prompt that fits"),
}


def _no_op_only(cls, value: Any, info: ValidationInfo) -> None:
    no_ops, instead = _UNSERVED[info.field_name]
    if not any(value == no_op and type(value) is type(no_op) for no_op in no_ops):
        raise ValueError(f"not supported by this server: {instead}")
    return None


# A field for each of `_UNSERVED`, accepted only at its no-op value; left out of the OpenAPI
# document, which describes what is served.
_Unserved = create_model(
    "_Unserved", __base__=Body,
    __validators__={"_no_op_only": field_validator(*_UNSERVED)(classmethod(_no_op_only))},
    **{name: (SkipJsonSchema[Any], None) for name in _UNSERVED},
)


class Sampling(_Unserved):
    """Fields shared by chat and text completions."""

    model: str | None = None
    keep_alive: KeepAlive = None
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
    cache_salt: str | None = cache_salt_field()
    lora: list[LoraScale] | None = Field(None, max_length=MAX_LORA)  # llama-server's per-request adapters

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


class PredictionText(Body):
    type: Literal["text"]
    text: str


class Prediction(Body):
    """OpenAI's Predicted Outputs: text the reply will likely repeat (a file being edited)."""

    type: Literal["content"]
    content: Union[str, list[PredictionText]]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    prediction: Prediction | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = Field(None, min_length=1)
    tool_choice: ToolChoiceField | None = None
    parallel_tool_calls: bool = True
    # Reasoning models: variables for the chat template (`enable_thinking: false`), the effort the
    # template is told (gpt-oss reads it), and the most tokens the reply may think (-1: no limit).
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    reasoning_budget: int | None = Field(None, ge=-1)
    # The pre-tools form of function calling: refused rather than ignored, and left out of the
    # OpenAPI document, which describes what is served.
    functions: SkipJsonSchema[list[dict[str, Any]] | None] = None
    function_call: SkipJsonSchema[Union[str, dict[str, Any], None]] = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_object(cls, value: Any) -> Any:
        """An object choice is told apart by its type, so its error names what is wrong in it
        rather than that it is not one of the strings."""
        if not isinstance(value, dict):
            return value
        try:
            return _CHOICE_OBJECT.validate_python(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"][1:])
            raise ValueError(f"{where}: {first['msg']}" if where else first["msg"]) from None

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @field_validator("functions", "function_call")
    @classmethod
    def _legacy_functions(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("functions and function_call are not supported: send tools and tool_choice")
        return None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampling):
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
