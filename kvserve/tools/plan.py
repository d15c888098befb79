"""One request's tool calling: what the prompt gains, the grammar, and the parser of the reply."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from kvserve.llama.chat_template import ChatTemplate
from kvserve.llama.model import Model
from kvserve.tools.formats import ToolFormat
from kvserve.tools.grammar import Thinking, ToolGrammar, tool_grammar
from kvserve.tools.schema_budget import check_tools as check_budget
from kvserve.tools.parser import ToolCallParser
from kvserve.tools.spec import NAME_PATTERN, FunctionTool, Mode, ToolChoice, ToolError


@dataclass(frozen=True)
class ToolPlan:
    """How one request calls tools. Only `callable` tools can be called; the model is shown all of
    them, so that a conversation whose choice changes keeps its prompt (and its cached prefix)."""

    format: ToolFormat
    tools: tuple[FunctionTool, ...]
    callable: tuple[FunctionTool, ...]
    choice: ToolChoice
    parallel: bool
    grammar: ToolGrammar | None  # None: the calls are read from free text (a format no grammar describes)

    @property
    def special_text(self) -> bool:
        """The reply must be read with special tokens spelled out: a marker may be one."""
        return self.format.opening is not None or self.format is ToolFormat.HARMONY

    def template(self, template: ChatTemplate) -> ChatTemplate:
        """`template` with the tools in its context, for templates that render them themselves."""
        if self.format is ToolFormat.GENERIC:
            return template
        return template.with_tools([tool.as_openai() for tool in self.tools])

    def prompt_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` with, in the generic mode, the tools and the reply's shape in the system prompt."""
        if self.format is not ToolFormat.GENERIC:
            return messages
        prompt = generic_system_prompt(self)
        if messages and messages[0]["role"] == "system":
            first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
            return [first, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    def after_thinking(self, thinking: Thinking | None) -> "ToolPlan":
        """This plan for a reply that thinks first: its grammar lets the thinking through, or waits
        for it to close (a `<think>` block, or harmony's analysis); None: no grammar."""
        if thinking is None:
            return replace(self, grammar=None)
        grammar = tool_grammar(self.format, list(self.callable), required=self.choice.mode is Mode.REQUIRED,
                               parallel=self.parallel, opening_token=None, thinking=thinking)
        return replace(self, grammar=grammar)

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.format, (tool.name for tool in self.callable),
                              forced=self.choice.mode is Mode.REQUIRED)


def check_tools(tools: list[FunctionTool], choice: ToolChoice) -> None:
    """Raises ToolError naming the field at fault."""
    if not tools:
        raise ToolError("tools must not be empty", "tools")
    seen: set[str] = set()
    for tool in tools:
        if not NAME_PATTERN.match(tool.name):
            raise ToolError(f"function names are 1 to 64 of a-z, A-Z, 0-9, _ and -: got {tool.name!r}",
                            f"{tool.param}.name")
        if tool.name in seen:
            raise ToolError(f"two tools are named {tool.name}", f"{tool.param}.name")
        seen.add(tool.name)
    unknown = [name for name in choice.allowed or () if name not in seen]
    if unknown:
        raise ToolError(f"tool_choice names {', '.join(unknown)}, which is not among the tools", "tool_choice")


def plan_tools(fmt: ToolFormat, model: Model, tools: list[FunctionTool], choice: ToolChoice,
               parallel: bool = True) -> ToolPlan | None:
    """The plan for a request with `tools`. With the choice `none` the tools stay unseen: there is
    no plan, except in the generic mode, whose replies keep their JSON shape (an answer only), the
    shape the conversation so far has shown the model. A named choice makes one call whatever
    `parallel` says. Raises ToolError for tools or a choice that cannot be served."""
    check_tools(tools, choice)
    check_budget(tools)
    parallel = parallel and not choice.named
    if choice.mode is Mode.NONE and fmt is not ToolFormat.GENERIC:
        return None
    allowed = set(choice.allowed) if choice.allowed is not None else None
    callable_tools = tuple(t for t in tools if choice.mode is not Mode.NONE and (allowed is None or t.name in allowed))
    grammar = tool_grammar(fmt, list(callable_tools), required=choice.mode is Mode.REQUIRED, parallel=parallel,
                           opening_token=_single_token(model, fmt.opening))
    return ToolPlan(fmt, tuple(tools), callable_tools, choice, parallel, grammar)


def _single_token(model: Model, text: str | None) -> int | None:
    """The token that spells `text` on its own, if the vocabulary has one: a trigger cheaper than a pattern."""
    if text is None:
        return None
    tokens = model.tokenize(text, add_special=False, parse_special=True)
    return tokens[0] if len(tokens) == 1 else None


def generic_system_prompt(plan: ToolPlan) -> str:
    if not plan.callable:
        return 'Reply with one JSON object: {"response": your answer as a string}'
    described = [{"name": t.name, **({"description": t.description} if t.description else {}),
                  "parameters": t.parameters} for t in plan.tools]
    call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
    lines = ["You can call these tools:", json.dumps(described, ensure_ascii=False), ""]
    if len(plan.callable) < len(plan.tools):
        lines.append(f"Now you may call only: {', '.join(t.name for t in plan.callable)}.")
    if plan.choice.mode is Mode.REQUIRED:
        lines.append(f"Reply with one JSON object that calls tools: {call}")
    else:
        lines.append(f'Reply with one JSON object: {call} to call tools, or {{"response": your answer as a string}} '
                     "to answer directly.")
    lines.append("Call tools one at a time." if not plan.parallel else "List several calls to make them at once.")
    lines.append('Tool results come back as user messages. When they answer the question, reply with '
                 '{"response": your answer as a string}.')
    return "\n".join(lines)
