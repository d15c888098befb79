"""GBNF for tool calls: the tools' schemas through the converter `response_format` uses, wrapped in
each format's call syntax.

Every grammar ends where the calls may end: after each complete call the model may stop (end of
generation), or, where `parallel` allows, open another. A named tool choice is one call.

A lazy grammar (`auto` on a format with an opening marker) waits for its trigger; llama.cpp then
replays the text from the trigger's first group to the end of what was generated into the grammar,
and a replay the grammar rejects aborts the process. So each trigger pattern matches only where the
text after the marker is a prefix the grammar accepts: the marker, then a prefix of the fixed
opening of a call, then the end of the text.

Hermes models also write calls in another tag (see `parser`). Two more triggers cover them, both
replayed from the call object's brace, so the lazy grammar's root has a second branch: one call,
then at most the variant's closing tag and fence. The tag (and a fence before it) stays free.
- A reply that opens with a tag (after a fence or not), then `{"name"`, while the name is still a
  prefix of a tool's, so that the grammar holds the name to a tool's.
- A tag anywhere, then `{"name": "<tool>"`, the name whole. An earlier point would constrain every
  `<json>{"name"` of free text.
llama.cpp matches each pattern against all the text the lazy grammar has seen, at every token, with
C++'s std::regex, which recurses once per character a quantifier takes: a pattern whose `*` can run
over the whole answer overflows the engine thread's stack once the answer passes some 40,000
characters (a crash, not an error). So no pattern has an unbounded quantifier over text it does
not end at: leading whitespace is at most `_WS_RUN`, the thinking's close is looked for near the
start only, and a pattern that may match anywhere is searched for (unanchored), not reached over
`[\\s\\S]*?`.

A call object without a tag is not a call (`formats.ToolFormat.openings`), so no trigger fires on
it: it stays free text. What none of the patterns catches (a token that runs past those points with
text the pattern does not list) stays free text and is still parsed: a call is reported only if it
names a tool and its arguments are a JSON object; the schema is not enforced on it.
"""

from __future__ import annotations

import copy
import enum
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

from kvserve.tools.formats import FENCE, HERMES_TAGS, ToolFormat
from kvserve.tools.int_range import integer_bounds, integer_range
from kvserve.tools.spec import FunctionTool, ToolError

# Whitespace the wrappers allow around a call, bounded so a weak model cannot stall in it.
_WS_RULE = "ws ::= [ \\t\\n]? [ \\t\\n]?"
_WS_REGEX = "[ \\t\\n]{0,2}"
# The pinned converter lets a string hold raw control characters, which JSON forbids: arguments
# would not parse. A string character is anything but a quote, a backslash or a control character.
_JSON_CHAR = re.compile(r"^char ::= .*$", re.MULTILINE)
_STRICT_JSON_CHAR = (r'char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] '
                     r'[0-9a-fA-F])')
# Whitespace a pattern lets run before a marker or an opening: bounded (see the module's doc).
_WS_RUN = "[ \\t\\n]{0,64}"
_REGEX_SYNTAX = re.compile(r"([\\^$.*+?()\[\]{}|/])")
# The converter writes a character past U+FFFF in a literal as JSON's surrogate pair (`\ud83d\ude00`),
# which llama.cpp reads as two lone surrogates: garbage. GBNF spells it `\U0001f600`. (An escaped
# backslash before a `u` is no escape: the run of backslashes before it must be even.)
_SURROGATE_PAIR = re.compile(r"(?<!\\)((?:\\\\)*)\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})", re.IGNORECASE)


def _fixed(gbnf: str) -> str:
    """The converter's grammar as JSON needs it: no raw control characters in strings (the pinned
    converter lets them through, and arguments would not parse), characters past U+FFFF whole."""
    gbnf = _JSON_CHAR.sub(lambda _: _STRICT_JSON_CHAR, gbnf)
    return _SURROGATE_PAIR.sub(
        lambda m: f"{m[1]}\\U{0x10000 + ((int(m[2], 16) - 0xD800) << 10) + int(m[3], 16) - 0xDC00:08x}", gbnf)


class _Converter(SchemaConverter):
    """The pinned converter, with an integer's minimum and maximum (which it ignores) held to."""

    def __init__(self, prop_order: dict[str, int] | None = None) -> None:
        super().__init__(prop_order=prop_order or {}, allow_fetch=False, dotall=False, raw_pattern=False)

    def visit(self, schema: Any, name: str) -> str:
        bounds = integer_bounds(schema) if isinstance(schema, dict) and schema.get("type") == "integer" else None
        if bounds is None:
            return super().visit(schema, name)
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"  # as the converter names it
        return self._add_rule(rule_name, f"({integer_range(*bounds)}) space")


def json_gbnf(schema: dict[str, Any]) -> str:
    """The grammar of JSON text that `schema` describes (response_format). The converter raises
    plain exceptions on schemas it cannot express (EmptyRange: no integer between the bounds)."""
    converter = _Converter()
    converter.visit(converter.resolve_refs(copy.deepcopy(schema), "stdin"), "")  # it rewrites $refs in place
    return _fixed(converter.format_grammar())


@dataclass(frozen=True)
class ToolGrammar:
    """A GBNF grammar (root rule `root`); with triggers it is lazy: free until one fires."""

    gbnf: str
    trigger_patterns: tuple[str, ...] = ()
    trigger_tokens: tuple[int, ...] = ()


def check_parameters(tool: FunctionTool) -> None:
    """A schema the converter cannot express is the client's error, named at the tool."""
    try:
        json_gbnf(tool.parameters)
    except Exception as exc:  # the converter raises plain exceptions on schemas it cannot express
        raise ToolError(f"unsupported parameters schema for {tool.name}: {exc}", f"{tool.param}.parameters") from exc


def tool_grammar(fmt: ToolFormat, tools: list[FunctionTool], *, required: bool, parallel: bool,
                 opening_token: int | None, thinking: Thinking | None = None) -> ToolGrammar:
    """The grammar for calls to `tools` in `fmt`: from the first token when `required` (or in the
    generic mode, where the reply is always one JSON object), else lazily from the opening marker.
    A reply that thinks first (`thinking`) gets its `<think>` block before the calls: a grammar
    from the first token lets it through, and a lazy one's patterns fire only after it closed."""
    for tool in tools:
        check_parameters(tool)
    if fmt is ToolFormat.HARMONY:
        return _harmony_grammar(tools, required, thinking)
    head = _THINK_RULES[thinking] if thinking is not None else ("", "")
    if fmt is ToolFormat.GENERIC:
        rules, reply = _converted(tools, fmt.arguments_key, "reply",
                                  lambda call: _generic_reply(call, required, parallel))
        return ToolGrammar(f"root ::= {head[0]}{reply}\n{head[1]}{_WS_RULE}\n{rules}")
    assert tools, "a format with call syntax needs a tool to call"
    rules, call = _converted(tools, fmt.arguments_key, "call", lambda call: call)
    root = _wrapped_root(fmt, call, parallel)
    if required:
        return ToolGrammar(f"root ::= {head[0]}({root})\n{head[1]}{_WS_RULE}\n{rules}")
    patterns = (_trigger_pattern(fmt),)
    if fmt is ToolFormat.HERMES:
        root = f"{root} | {_variant_root(call)}"
        patterns += (_leading_variant_pattern(tools), _variant_trigger_pattern(tools, fmt.arguments_key))
    gbnf = f"root ::= {root}\n{_WS_RULE}\n{rules}"
    if thinking is not None:  # a token trigger would fire inside the thinking too
        return ToolGrammar(gbnf, tuple(_after_thinking(p, thinking) for p in patterns))
    return ToolGrammar(gbnf, patterns, (opening_token,) if opening_token is not None else ())


class Thinking(str, enum.Enum):
    """Where a reply's `<think>` block is: opened by the prompt, or perhaps by the reply itself.
    In harmony: the prompt opened the analysis body, or the reply writes its first header (after
    the prompt's `<|start|>assistant`), perhaps an analysis message's."""

    OPEN = "open"
    OPTIONAL = "optional"


# Thinking text: anything that does not spell `</think>` (a `<` takes the character after it along).
_THINK_TEXT = ('think-text ::= ([^<] | "<" ([^/] | "/" ([^t] | "t" ([^h] | "h" ([^i] | "i" ([^n] | "n" '
               '([^k] | "k" [^>])))))))*')
# Per placement: what the root starts with, and the rules it needs.
_THINK_RULES = {
    Thinking.OPEN: ('think-text "</think>" ws ', f"{_THINK_TEXT}\n"),
    Thinking.OPTIONAL: ('("<think>" think-text "</think>" ws)? ', f"{_THINK_TEXT}\n"),
}
# An anchored pattern's gate: the text before the trigger has closed its thinking (or never opened
# any). The engine arms a lazy grammar only once the thinking closed, replaying the tokens from the
# close's first on (`scheduler.thinking`): the text it sees starts at most a token before the close.
_GATES = {
    Thinking.OPEN: r"^[\s\S]{0,256}?</think>",
    Thinking.OPTIONAL: rf"^(?:{_WS_RUN}(?:<think>)?[\s\S]{{0,256}}?</think>|(?!{_WS_RUN}<think>))",
}


def _after_thinking(pattern: str, thinking: Thinking) -> str:
    """`pattern`, matching only past the thinking: a pattern anchored at the reply's start is
    anchored at the thinking's end instead. Any other already is: the grammar sees no thinking
    (the engine keeps it out of the chain until the thinking closed), and a marker cannot match
    inside the close."""
    return _GATES[thinking] + pattern[1:] if pattern.startswith("^") else pattern


def thinking_first(gbnf: str, thinking: Thinking, harmony: bool = False) -> str:
    """A response_format grammar (`json_gbnf`) for a reply that thinks first: its thinking block
    (harmony: its analysis message, then the final message's header), then the JSON."""
    body = re.sub(r"^root ::= ", "json-root ::= ", gbnf, count=1, flags=re.MULTILINE)
    if harmony:
        return f'root ::= {_ANALYSIS_HEAD[thinking]}"<|channel|>final<|message|>" json-root\n{_ANALYSIS_TEXT}\n{body}'
    head, rules = _THINK_RULES[thinking]
    return f"root ::= {head}json-root\n{rules}{_WS_RULE}\n{body}"


def _converted(tools: list[FunctionTool], arguments_key: str, top: str,
               wrap: Callable[[dict | None], dict]) -> tuple[str, str]:
    """The converter's rules for `wrap(one call object)` and the name of its top rule (`top`, or
    a variant of it)."""
    converter = _Converter(prop_order={"name": 0, arguments_key: 1})
    calls = []
    for i, tool in enumerate(tools):
        # Each tool's $refs point into its own schema: resolve them there, under names of its own.
        parameters = converter.resolve_refs(_namespaced(tool.parameters, f"t{i}-"), f"tool{i}")
        calls.append({"type": "object", "properties": {"name": {"const": tool.name}, arguments_key: parameters},
                      "required": ["name", arguments_key]})
    call = (calls[0] if len(calls) == 1 else {"anyOf": calls}) if calls else None
    top = converter.visit(wrap(call), top)
    return _fixed(converter.format_grammar()), top


def _generic_reply(call: dict | None, required: bool, parallel: bool) -> dict:
    """`{"tool_calls": [call, ...]}` (unless no tool may be called), or (unless required)
    `{"response": "..."}`."""
    answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}
    if call is None:
        return answer
    calls = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    with_calls = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]}
    return with_calls if required else {"anyOf": [with_calls, answer]}


def _namespaced(schema: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A copy whose local definitions (and the refs to them) carry `prefix`: the converter names a
    referenced rule after the last segment of its ref, so two tools' `Item`s would share one rule."""
    schema = copy.deepcopy(schema)
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            schema[key] = {prefix + name: value for name, value in schema[key].items()}

    def rename(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
                container, _, name = ref[2:].partition("/")
                node["$ref"] = f"#/{container}/{prefix}{name}"
            for value in node.values():
                rename(value)
        elif isinstance(node, list):
            for value in node:
                rename(value)

    rename(schema)
    return schema


def _wrapped_root(fmt: ToolFormat, call: str, parallel: bool) -> str:
    if fmt is ToolFormat.HERMES:
        one = f'"<tool_call>" ws {call} ws "</tool_call>"'
        return f"{one} (ws {one})* ws" if parallel else f"{one} ws"
    if fmt is ToolFormat.MISTRAL:
        more = f' ("," " "? {call})*' if parallel else ""
        return f'"[TOOL_CALLS]" " "? "[" " "? {call}{more} "]"'
    return call  # LLAMA3: one call is the whole reply


def _variant_root(call: str) -> str:
    """A Hermes variant's call from its brace on: then its closing tag, its closing fence, or neither."""
    closers = " | ".join(f'"</{tag}>"' for tag in HERMES_TAGS)
    return f'{call} ws (({closers}) ws)? ("{FENCE}" ws)?'


# A Hermes variant's tag and the whitespace after it, before the call object.
_VARIANT_TAG = f"<(?:{'|'.join(HERMES_TAGS)})>{_WS_RUN}"


def _leading_variant_pattern(tools: list[FunctionTool]) -> str:
    """A reply that opens with a tag (in a fence or not), then a call object from `{"name"` on,
    before its name is whole, so that the grammar also holds the name to a tool's."""
    names = "|".join(_prefixes([_literal(c) for c in tool.name]) for tool in tools)
    fence = f"(?:{_literal(FENCE)}(?:json|xml)?\\n{_WS_RUN})?"
    head = f'({_literal("{")} ?"name")'
    name = '"(?:' + names + ")"
    return f"^{_WS_RUN}{fence}{_VARIANT_TAG}{head}{_prefixes([' ?', ':', ' ?', name])}$"


def _variant_trigger_pattern(tools: list[FunctionTool], arguments_key: str) -> str:
    """A tag, then `{"name": "<tool>"` (as the converter's rules space it), then any prefix of what follows."""
    names = "|".join(_literal(tool.name) for tool in tools)
    head = f'({_literal("{")} ?"name" ?: ?"(?:{names})")'
    key = [_literal(c) for c in '"' + arguments_key + '"']
    return f"{_VARIANT_TAG}{head}{_prefixes([',', ' ?', *key, ' ?', ':'])}$"


def _trigger_pattern(fmt: ToolFormat) -> str:
    """The marker as the pattern's first group, then any prefix of what the grammar expects next."""
    open_object = [_literal("{"), " ?", *(_literal(c) for c in '"name"')]
    if fmt is ToolFormat.HERMES:
        return f"({_literal('<tool_call>')}){_prefixes([_WS_REGEX, *open_object])}$"
    if fmt is ToolFormat.MISTRAL:
        return f"({_literal('[TOOL_CALLS]')}){_prefixes([' ?', _literal('['), ' ?', *open_object])}$"
    return f"^{_WS_RUN}({open_object[0]}){_prefixes(open_object[1:])}$"  # LLAMA3: a reply that opens an object


def _literal(text: str) -> str:
    return _REGEX_SYNTAX.sub(r"\\\1", text)


def _prefixes(atoms: list[str]) -> str:
    """A regex for any prefix of the sequence `atoms`, the empty one included."""
    if not atoms:
        return ""
    return f"(?:{atoms[0]}{_prefixes(atoms[1:])})?"


# -- harmony (gpt-oss) ----------------------------------------------------------------------------------
# A call is a message: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}`,
# or recipient first, ` to=functions.NAME<|channel|>commentary json<|message|>{args}`, right after
# `<|start|>assistant`; `<|call|>` (end of generation) follows. The analysis before it is free text
# up to its `<|end|>`.
_H_CHANNEL_CALL = "<|channel|>commentary to=functions."
_H_RECIPIENT_CALL = " to=functions."
# Analysis text: anything that does not spell `<|end|>`.
_ANALYSIS_TEXT = ('analysis-text ::= ([^<] | "<" ([^|] | "|" ([^e] | "e" ([^n] | "n" ([^d] | "d" ([^|] | "|" '
                  '[^>]))))))*')
_ANALYSIS_HEAD = {
    Thinking.OPEN: 'analysis-text "<|end|><|start|>assistant" ',
    Thinking.OPTIONAL: '("<|channel|>analysis<|message|>" analysis-text "<|end|><|start|>assistant")? ',
}


def _harmony_grammar(tools: list[FunctionTool], required: bool, thinking: Thinking | None) -> ToolGrammar:
    """One call message to one of `tools`, its arguments held to the tool's schema. Required: from
    the reply's first token, after an analysis message (`thinking`: the prompt opened its body, or
    the reply may write one; None: as OPTIONAL, the prompt ending in `<|start|>assistant`). Else
    lazy, from the recipient prefix of a call's header."""
    assert tools, "a format with call syntax needs a tool to call"
    converter = _Converter()
    channel_first, recipient_first = [], []
    for i, tool in enumerate(tools):
        parameters = converter.resolve_refs(_namespaced(tool.parameters, f"t{i}-"), f"tool{i}")
        arguments = converter.visit(parameters, f"arguments{i}")
        name = json.dumps(tool.name)
        channel_first.append(f"{name} harmony-json {arguments}")
        recipient_first.append(f'{name} "<|channel|>commentary" harmony-json {arguments}')
    rules = _fixed(converter.format_grammar())
    call = (f'"{_H_CHANNEL_CALL}" ({" | ".join(channel_first)}) | '
            f'"{_H_RECIPIENT_CALL}" ({" | ".join(recipient_first)})')
    common = f'harmony-json ::= " "? ("<|constrain|>"? "json")? "<|message|>"\n{_WS_RULE}\n{rules}'
    if required:
        head = _ANALYSIS_HEAD[thinking or Thinking.OPTIONAL]
        return ToolGrammar(f"root ::= {head}({call})\n{_ANALYSIS_TEXT}\n{common}")
    names = "|".join(_prefixes([_literal(c) for c in tool.name]) for tool in tools)
    patterns = (f"({_literal(_H_CHANNEL_CALL)})(?:{names})$",  # searched for: anywhere
                f"(?:^|{_literal('<|start|>assistant')})({_literal(_H_RECIPIENT_CALL)})(?:{names})$")
    return ToolGrammar(f"root ::= {call}\n{common}", patterns)
