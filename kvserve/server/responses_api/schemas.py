"""The body of `POST /v1/responses`: the subset of OpenAI's Responses API that kvserve serves.

Unknown fields are ignored, as elsewhere; known fields that would change the answer in a way this
server cannot honour (hosted tools, background runs, conversations, images) are a 400 naming them.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Union

from pydantic import Field, Tag, ValidationInfo, field_validator, model_validator

from kvserve.server.schemas import MAX_TOP_LOGPROBS, Body, KeepAlive, cache_salt_field, tagged
from kvserve.tools.spec import NAME_PATTERN

MAX_METADATA_PAIRS = 16


class TextContent(Body):
    """Text in a message: the client's (`input_text`) or an earlier answer's (`output_text`)."""

    type: Literal["input_text", "output_text"]
    text: str


class RefusalContent(Body):
    type: Literal["refusal"]
    refusal: str


Content = Annotated[
    Union[Annotated[TextContent, Tag("TextContent")], Annotated[RefusalContent, Tag("RefusalContent")]],
    tagged((TextContent, ("input_text", "output_text")), (RefusalContent, ("refusal",)),
            refusal="content parts are input_text, output_text or refusal: this server reads text only"),
]


def content_text(content: str | list[Content]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.text if isinstance(part, TextContent) else part.refusal for part in content)


class MessageItem(Body):
    type: Literal["message"] = "message"
    id: str | None = None  # every item may carry one; a stored item always does (`input_items`)
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[Content]]


class FunctionCallItem(Body):
    """A call the model made earlier; `call_id` pairs it with its output."""

    type: Literal["function_call"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    output: Union[str, list[TextContent]]


class ReasoningText(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Body):
    """An earlier turn's thinking, sent back: the template of the next assistant turn keeps or
    drops it. Encrypted content (another server's) cannot be read here and is left out."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("MessageItem")],
        Annotated[FunctionCallItem, Tag("FunctionCallItem")],
        Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")],
        Annotated[ReasoningItem, Tag("ReasoningItem")],
    ],
    tagged((MessageItem, ("message", None)), (FunctionCallItem, ("function_call",)),
            (FunctionCallOutputItem, ("function_call_output",)),  # a message may leave out its type
            (ReasoningItem, ("reasoning",)),
            refusal="input items are message, function_call, function_call_output or reasoning"),
]


class FunctionTool(Body):
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN.pattern)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Body):
    """Call this function (and only it)."""

    type: Literal["function"]
    name: str


class AllowedToolsChoice(Body):
    """Call only these functions: `auto` may answer in text, `required` must call one."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[FunctionChoice] = Field(min_length=1)


ToolChoiceMode = Literal["none", "auto", "required"]
ToolChoice = Annotated[
    Union[
        Annotated[ToolChoiceMode, Tag("ToolChoiceMode")],
        Annotated[FunctionChoice, Tag("FunctionChoice")],
        Annotated[AllowedToolsChoice, Tag("AllowedToolsChoice")],
    ],
    tagged((FunctionChoice, ("function",)), (AllowedToolsChoice, ("allowed_tools",)), strings="ToolChoiceMode",
            refusal="tool_choice is none, auto, required, or a function or allowed_tools choice: "
                    "this server calls function tools only"),
]


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs a schema")
        return self


class TextConfig(Body):
    format: TextFormat = Field(default_factory=TextFormat)


class Reasoning(Body):
    """The effort is told to the chat template (as `reasoning_effort`); no summary is written."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


Includable = Literal[
    "message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
    "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs",
]  # all of OpenAI's; only logprobs concern items this server produces, the rest have nothing to add


# Per field: does its value ask for something this server lacks, and the 400 that says so.
_UNSERVED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "truncation": (lambda v: v == "auto", "truncation 'auto' is not supported; the input is never cut"),
    "background": (bool, "background responses are not supported"),
    "conversation": (lambda v: v is not None, "conversations are not supported; use previous_response_id"),
    "prompt": (lambda v: v is not None, "stored prompt templates are not supported"),
}


class CreateResponse(Body):
    model: str | None = None
    keep_alive: KeepAlive = None
    input: Union[str, list[InputItem]] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Not OpenAI's Responses fields, but chat's, as vLLM accepts them here too: small models loop.
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    reasoning_budget: int | None = Field(None, ge=-1)  # chat's extension: most thinking tokens (-1: no limit)
    include: list[Includable] | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    cache_salt: str | None = cache_salt_field()
    # Accepted only in the form that asks for nothing this server lacks:
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    reasoning: Reasoning | None = None
    conversation: Union[str, dict[str, Any], None] = None
    prompt: dict[str, Any] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for index, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools[{index}] is a {kind!r} tool; this server calls function tools only")
        return tools

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs")
        if any(len(key) > 64 or len(value) > 512 for key, value in metadata.items()):
            raise ValueError("keys are at most 64 characters, values at most 512")
        return metadata

    @field_validator("truncation", "background", "conversation", "prompt")
    @classmethod
    def _nothing_unserved(cls, value: Any, info: ValidationInfo) -> Any:
        asks_for, refusal = _UNSERVED[info.field_name]
        if asks_for(value):
            raise ValueError(refusal)
        return value

    @property
    def items(self) -> list[InputItem]:
        """The input as items: a string is one user message."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or [])
