"""How much grammar a JSON schema would become, measured before any of it is built.

llama.cpp's schema converter writes every bounded repetition out in full: `maxItems: N` is N
copies of the item's rule, nested N parentheses deep, so a schema of a few bytes can ask for
gigabytes of grammar text; a pattern's group that may match nothing, repeated N times, is N ways
through it that the sampler follows at every token (`(a?){1000}` stalls every sequence in the
batch for minutes per token); each `enum` value or `anyOf` branch is an alternative the sampler
checks against the whole vocabulary at every token. `check_schema` walks the schema once, with
nothing allocated beyond the walk, and refuses (`SchemaTooLarge`, a `ToolError` naming the request
field and the limit) whatever is over the budget below, before the converter starts.

The walk over-estimates: it counts every part of the schema (unused `$defs` too) and names rules by
their JSON path, which is at least as long as the converter's names.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvserve.tools.spec import FunctionTool, ToolError

MAX_DEPTH = 64  # nested JSON objects and arrays inside one schema
MAX_REPEAT = 4096  # any one minItems, maxItems, minLength, maxLength or {m,n} of a pattern
MAX_GROUP_REPEAT = 32  # a pattern's {m,n} on a group or on a quantified atom, multiplied through nested groups
MAX_ALTERNATIVES = 1024  # enum values, anyOf/oneOf branches, or properties, in one place
MAX_GRAMMAR_CHARS = 1 << 20  # grammar text, estimated before converting and measured after
MAX_TOOLS = 128  # tools in one request (OpenAI's own limit)

_BOUNDS = ("minItems", "maxItems", "minLength", "maxLength")
_INTEGER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_INTEGER_RANGE = 2560  # the most text a range of 19-digit integers takes (2,041 measured, -9.9e17 to 9.9e17)
_NAMED_SCHEMAS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")
_PRIMITIVES = 2048  # the fixed rules a grammar may include (string, char, number, value, ...)
_RULE_OVERHEAD = 32  # a rule's `name ::= ` line and its punctuation
_COPY_OVERHEAD = 16  # what each written-out copy adds besides the item's name: `( "," space ... )?`


class SchemaTooLarge(ToolError):
    """A schema whose grammar would be over the budget; `param` names the schema's field."""


def check_schema(schema: Any, param: str) -> int:
    """The estimated grammar size of `schema` in characters; SchemaTooLarge if any limit is passed."""
    walk = _Walk(schema, param)
    size = _PRIMITIVES + walk.cost(schema, 0, 0)
    _check_size(size, param, "is estimated at")
    return size


def check_tools(tools: list[FunctionTool]) -> None:
    """Every tool's parameter schema within the budget, and all of them together."""
    if len(tools) > MAX_TOOLS:
        raise SchemaTooLarge(f"{len(tools)} tools is more than the {MAX_TOOLS} one request may carry", "tools")
    total = sum(check_schema(tool.parameters, f"{tool.param}.parameters") for tool in tools)
    _check_size(total, "tools", "of all tools together is estimated at")


def check_grammar_text(gbnf: str, param: str) -> None:
    """The converted grammar itself within the budget (the estimate bounds it; this states it)."""
    _check_size(len(gbnf), param, "is")


def _check_size(size: int, param: str, how: str) -> None:
    if size > MAX_GRAMMAR_CHARS:
        raise SchemaTooLarge(f"the grammar for this schema {how} {size} characters, more than the "
                             f"{MAX_GRAMMAR_CHARS} allowed", param)


class _Walk:
    """One walk over one schema: `cost` is the estimated grammar text of a node whose rule name is
    `name` characters long, `depth` levels down."""

    def __init__(self, root: Any, param: str) -> None:
        self.root = root
        self.param = param
        self.refs: dict[str, int] = {}  # the cost of a referenced schema, once known (0 while walking it)

    def refuse(self, message: str) -> SchemaTooLarge:
        return SchemaTooLarge(message, self.param)

    def cost(self, node: Any, name: int, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise self.refuse(f"the schema nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, list):
            return sum(self.cost(item, name + 4, depth + 1) for item in node)
        if not isinstance(node, dict):
            return 0  # a keyword's value: what the grammar takes of it is counted at its schema
        # its rule's name, defined once and referred to (at most twice) by its parent's rule
        size = _RULE_OVERHEAD + 3 * name + self.repetitions(node, name) + self.alternatives(node)
        if node.get("type") == "integer" and any(key in node for key in _INTEGER_BOUNDS):
            size += _INTEGER_RANGE  # `int_range` writes its integers out
        for key, value in node.items():
            if key in ("enum", "const"):
                continue  # counted by alternatives
            if key in _NAMED_SCHEMAS and isinstance(value, dict):
                size += sum(self.cost(v, name + len(k) + 1, depth + 1) + 2 * (name + len(k)) + _RULE_OVERHEAD
                            for k, v in value.items())
            elif isinstance(value, (dict, list)):
                size += self.cost(value, name + len(key) + 1, depth + 1)
        size += self.all_of_refs(node, name, depth)
        _check_size(size, self.param, "is estimated at more than")
        return size

    def repetitions(self, node: dict, name: int) -> int:
        """Bounded repetitions are written out: each bound costs that many copies of the item."""
        copies = max([self.bound(node, key) for key in _BOUNDS], default=0)
        pattern = node.get("pattern")
        text = 0
        if isinstance(pattern, str):
            text = 2 * len(pattern)
            for match in _QUANTIFIER.finditer(pattern):
                copies += max(self.number(group, "a {m,n} of pattern") for group in match.groups())
            groups = _group_repeats(pattern)
            if groups > MAX_GROUP_REPEAT:
                raise self.refuse(f"pattern repeats a group (or a quantified atom) {groups} times, more than the "
                                  f"{MAX_GROUP_REPEAT} allowed")
        return text + copies * (name + 8 + _COPY_OVERHEAD)

    def bound(self, node: dict, key: str) -> int:
        value = node.get(key)
        if value is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf") \
                or value % 1:
            raise self.refuse(f"{key} must be a non-negative integer")
        return self.number(int(value), key)

    def number(self, value: int | str | None, what: str) -> int:
        count = _count(value)
        if count > MAX_REPEAT:
            shown = count if count < 10**12 else f"{count:.3g}"
            raise self.refuse(f"{what} is {shown}, more than the {MAX_REPEAT} a grammar may write out")
        return count

    def alternatives(self, node: dict) -> int:
        """Choices at one place: enum values (their JSON text is the grammar's), branches, properties."""
        enum = node.get("enum")
        for key in ("enum", "anyOf", "oneOf", "properties"):
            value = node.get(key)
            if isinstance(value, (list, dict)) and len(value) > MAX_ALTERNATIVES:
                raise self.refuse(f"{key} has {len(value)} entries, more than the {MAX_ALTERNATIVES} allowed")
        literals = list(enum) if isinstance(enum, list) else []
        if "const" in node:
            literals.append(node["const"])
        return sum(2 * len(json.dumps(value)) + 4 for value in literals)

    def all_of_refs(self, node: dict, name: int, depth: int) -> int:
        """The converter copies the properties of each schema an allOf refers to: each use costs it again."""
        parts = node.get("allOf")
        if not isinstance(parts, list):
            return 0
        refs = [part.get("$ref") for part in parts if isinstance(part, dict)]
        refs += [alt.get("$ref") for part in parts if isinstance(part, dict) and isinstance(part.get("anyOf"), list)
                 for alt in part["anyOf"] if isinstance(alt, dict)]
        return sum(self.ref_cost(ref, name, depth) for ref in refs if isinstance(ref, str))

    def ref_cost(self, ref: str, name: int, depth: int) -> int:
        if ref not in self.refs:
            self.refs[ref] = 0  # a schema that refers to itself: the converter refuses the loop
            target = self.resolve(ref)
            self.refs[ref] = self.cost(target, name, depth + 1) if target is not None else 0
        return self.refs[ref]

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#/"):
            return None  # the converter refuses remote refs
        target = self.root
        for part in ref[2:].split("/"):
            if not isinstance(target, dict) or part not in target:
                return None
            target = target[part]
        return target


def _count(digits: int | str | None) -> int:
    """A quantifier's number; one too long to read (Python refuses ints of thousands of digits) is huge."""
    if isinstance(digits, int):
        return digits
    return int(digits) if digits and len(digits) <= 12 else (10**12 if digits else 0)


def _quantifier_at(pattern: str, at: int) -> tuple[int, int]:
    """The largest bound of a {m,n} starting at `at` (1 if none starts there), and where it ends."""
    match = _QUANTIFIER.match(pattern, at)
    if match is None:
        return 1, at
    return max(_count(group) for group in match.groups()), match.end()


def _group_repeats(pattern: str) -> int:
    """The largest product of the {m,n} bounds on groups (and on atoms already quantified, as in
    `a?{9}`) through nested groups, a repeated group's bound counted once per optional piece in it
    (a `?`, `*` or `{0,n}`, or an alternative): how many ways through one repeated piece the sampler
    may track. Measured on llama.cpp, a token took 30-50 ms at 32 such ways (`(a?b?){16}`,
    `(a?b?c?d?){8}`, `(a?){32}`) and 0.8-2.7 s at 64 (`(a|b?){32}`, `(a?b?){32}`)."""
    inside = [1]  # per open group: the largest product within it so far
    optional = [0]  # per open group: its optional pieces at its own level
    at = 0
    while at < len(pattern):
        char = pattern[at]
        if char == "\\":
            at += 2
            continue
        if char == "[":
            at = _class_end(pattern, at)
        elif char == "(":
            inside.append(1)
            optional.append(0)
            if pattern.startswith("?", at + 1):  # (?: (?= (?!: no quantifier
                at += 1
        elif char == ")" and len(inside) > 1:
            bound, at = _quantifier_at(pattern, at + 1)
            ways = max(1, optional.pop()) if bound > 1 else 1
            within = inside.pop() * bound * ways
            inside[-1] = max(inside[-1], within)
            continue
        elif char in "?*|":
            optional[-1] += 1
            if char != "|" and pattern.startswith("{", at + 1):
                bound, at = _quantifier_at(pattern, at + 1)
                inside[-1] = max(inside[-1], bound)
                continue
        elif char == "}" and pattern.startswith("{", at + 1):
            bound, at = _quantifier_at(pattern, at + 1)
            inside[-1] = max(inside[-1], bound)
            continue
        elif char == "{" and re.match(r"\{\s*0\s*[,}]", pattern[at:]):
            optional[-1] += 1
        at += 1
    return max(inside)


def _class_end(pattern: str, at: int) -> int:
    """Where the character class opening at `at` closes (its `]`), escapes skipped."""
    at += 1
    while at < len(pattern) and pattern[at] != "]":
        at += 2 if pattern[at] == "\\" else 1
    return at
