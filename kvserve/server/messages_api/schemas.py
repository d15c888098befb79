"""The bodies of `POST /v1/messages` and `/v1/messages/count_tokens`: the part of Anthropic's
Messages API a text model can honour, and its error shape.

Unknown fields are ignored, as elsewhere; content blocks and tools this server cannot serve
(images, documents, server tools) are a 400 naming them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field, Tag, field_validator, model_validator

from kvserve.server.schemas import Body, KeepAlive, cache_salt_field, tagged
from kvserve.tools.spec import NAME_PATTERN


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every 4xx and 5xx body of the Messages routes: Anthropic's error shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class TextBlock(Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(Body):
    """A call the assistant made earlier; its `id` pairs it with its result."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ThinkingBlock(Body):
    """An assistant's earlier thinking, sent back: the template keeps or drops it. Its signature
    is not checked (this server signs nothing)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Body):
    """Thinking another server encrypted: nothing here can read it, so it is left out."""

    type: Literal["redacted_thinking"]
    data: str = ""


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Union[str, list[TextBlock]] = ""
    is_error: bool = False


Block = Annotated[
    Union[
        Annotated[TextBlock, Tag("TextBlock")],
        Annotated[ToolUseBlock, Tag("ToolUseBlock")],
        Annotated[ToolResultBlock, Tag("ToolResultBlock")],
        Annotated[ThinkingBlock, Tag("ThinkingBlock")],
        Annotated[RedactedThinkingBlock, Tag("RedactedThinkingBlock")],
    ],
    tagged((TextBlock, ("text",)), (ToolUseBlock, ("tool_use",)), (ToolResultBlock, ("tool_result",)),
           (ThinkingBlock, ("thinking",)), (RedactedThinkingBlock, ("redacted_thinking",)),
           refusal="content blocks are text, thinking, tool_use or tool_result: this server reads text only"),
]


class InputMessage(Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]

    @model_validator(mode="after")
    def _blocks_fit_role(self) -> "InputMessage":
        blocks = [] if isinstance(self.content, str) else self.content
        if self.role == "user" and any(isinstance(b, ToolUseBlock) for b in blocks):
            raise ValueError("tool_use blocks belong to assistant messages")
        if self.role == "assistant" and any(isinstance(b, ToolResultBlock) for b in blocks):
            raise ValueError("tool_result blocks belong to user messages")
        if self.role == "user" and any(isinstance(b, (ThinkingBlock, RedactedThinkingBlock)) for b in blocks):
            raise ValueError("thinking blocks belong to assistant messages")
        return self


class Tool(Body):
    """A client tool; Anthropic's server tools (web search, bash, ...) are not served."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=NAME_PATTERN.pattern)
    description: str | None = None
    input_schema: dict[str, Any]


class _Choice(Body):
    disable_parallel_tool_use: bool = False  # at most one call


class AutoChoice(_Choice):
    type: Literal["auto"]


class AnyChoice(_Choice):
    """Call some tool."""

    type: Literal["any"]


class NamedChoice(_Choice):
    """Call this tool."""

    type: Literal["tool"]
    name: str


class NoChoice(Body):
    type: Literal["none"]


ToolChoice = Annotated[
    Union[
        Annotated[AutoChoice, Tag("AutoChoice")],
        Annotated[AnyChoice, Tag("AnyChoice")],
        Annotated[NamedChoice, Tag("NamedChoice")],
        Annotated[NoChoice, Tag("NoChoice")],
    ],
    tagged((AutoChoice, ("auto",)), (AnyChoice, ("any",)), (NamedChoice, ("tool",)), (NoChoice, ("none",)),
           refusal="tool_choice is of type auto, any, tool or none"),
]


class ThinkingEnabled(Body):
    """Think first, at most `budget_tokens` tokens (they count toward max_tokens)."""

    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)


class ThinkingDisabled(Body):
    type: Literal["disabled"]


Thinking = Annotated[
    Union[Annotated[ThinkingEnabled, Tag("ThinkingEnabled")], Annotated[ThinkingDisabled, Tag("ThinkingDisabled")]],
    tagged((ThinkingEnabled, ("enabled",)), (ThinkingDisabled, ("disabled",)),
           refusal="thinking is of type enabled or disabled"),
]


class Metadata(Body):
    user_id: str | None = Field(None, max_length=256)
    cache_salt: str | None = cache_salt_field()  # vLLM's field, where Anthropic's bodies keep extras


class CountTokens(Body):
    """What a prompt is made of: the body of count_tokens, and the start of every message request."""

    model: str | None = None  # the model's name or alias (any name, where one model is served)
    keep_alive: KeepAlive = None
    messages: list[InputMessage] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools_only(cls, tools: Any) -> Any:
        for index, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(f"tools[{index}] is a {kind!r} tool; this server calls client tools only")
        return tools


class CreateMessage(CountTokens):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False

    @model_validator(mode="after")
    def _budget_within_max_tokens(self) -> "CreateMessage":
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self
