"""What a request asks of tool calling, in API-neutral terms."""

from __future__ import annotations

import enum
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

# OpenAI's rule for function names; it also keeps names safe inside grammars and prompts.
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A tool request the server cannot honour; `param` names the offending request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class FunctionTool:
    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: dict(NO_PARAMETERS))  # JSON schema of the arguments
    description: str | None = None
    strict: bool = False
    param: str = "tools"  # where the tool sits in the request, for error messages

    def as_openai(self) -> dict[str, Any]:
        """The Chat Completions form, which chat templates that know tools are written against."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


class Mode(str, enum.Enum):
    NONE = "none"  # no call; the tools are not shown to the model
    AUTO = "auto"  # text or calls, the model decides
    REQUIRED = "required"  # at least one call, nothing else


@dataclass(frozen=True)
class ToolChoice:
    """`allowed`: the names the model may call; None: all. A named choice (`named`) is REQUIRED with
    one name, and exactly one call: OpenAI's contract for a named function."""

    mode: Mode = Mode.AUTO
    allowed: tuple[str, ...] | None = None
    named: bool = False

    @staticmethod
    def function(name: str) -> "ToolChoice":
        return ToolChoice(Mode.REQUIRED, (name,), named=True)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as generated


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
