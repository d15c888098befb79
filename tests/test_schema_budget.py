"""The schema budget: what it refuses (naming the field and the limit), that every real schema
fits it (pydantic models as instructor and pydantic-ai send them, OpenAI's strict form, the Agents
SDK's tools and outputs), that its estimate bounds the grammar the converter writes, and, with
generated schemas, that a response_format or a tool is either a 400 naming its field or a grammar
llama.cpp compiles: never anything else."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Iterator, Literal, Optional

import agents
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from kvserve.llama.chat_template import ChatTemplate
from kvserve.llama.model import Model
from kvserve.llama.sampler import Sampler, SamplingParams
from kvserve.server import prompts
from kvserve.server.errors import APIError
from kvserve.server.schemas import ChatCompletionRequest
from kvserve.tools.schema_budget import (
    MAX_ALTERNATIVES, MAX_DEPTH, MAX_GRAMMAR_CHARS, MAX_REPEAT, MAX_TOOLS, SchemaTooLarge, check_schema, check_tools,
)
from kvserve.tools.grammar import json_gbnf
from kvserve.tools.spec import FunctionTool


@pytest.fixture(scope="module")
def model(smollm2: Path) -> Iterator[Model]:
    loaded = Model(smollm2)
    yield loaded
    loaded.close()


def ints(**bounds: Any) -> dict:
    return {"type": "array", "items": {"type": "integer"}, **bounds}


def nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


OVER = {
    "maxItems": (ints(maxItems=10**9), "maxItems is 1000000000"),
    "minItems": (ints(minItems=MAX_REPEAT + 1), f"more than the {MAX_REPEAT}"),
    "maxLength": ({"type": "string", "maxLength": 10**12}, "maxLength"),
    "minLength": ({"type": "string", "minLength": MAX_REPEAT + 1}, "minLength"),
    "negative": (ints(maxItems=-1), "non-negative integer"),
    "fraction": (ints(maxItems=2.5), "non-negative integer"),
    "not-a-number": (ints(minItems="3"), "non-negative integer"),
    "pattern": ({"type": "string", "pattern": "^(ab){2,99999}$"}, "pattern"),
    "infinite": (ints(maxItems=float("inf")), "non-negative integer"),
    "nullable-group": ({"type": "string", "pattern": "^(a?){1000}$"}, "1000 times"),
    "nested-groups": ({"type": "string", "pattern": "^((a?){30}){30}$"}, "900 times"),
    "quantified-atom": ({"type": "string", "pattern": "^a?{99}$"}, "99 times"),
    # each optional piece of a repeated group is another way through each repetition (0.8-2.7 s a
    # token at 64 ways on llama.cpp; minutes at 128)
    "optional-pieces": ({"type": "string", "pattern": "^(a?b?c?d?){0,32}$"}, "128 times"),
    "nullable-alternative": ({"type": "string", "pattern": "^(a|b?){32}$"}, "64 times"),
    "unreadable-number": ({"type": "string", "pattern": "^(x){" + "9" * 5000 + "}$"}, "pattern"),
    "enum": ({"enum": list(range(MAX_ALTERNATIVES + 1))}, f"more than the {MAX_ALTERNATIVES}"),
    "anyOf": ({"anyOf": [{"const": i} for i in range(MAX_ALTERNATIVES + 1)]}, "anyOf"),
    "properties": ({"type": "object", "properties": {f"p{i}": {} for i in range(MAX_ALTERNATIVES + 1)}}, "properties"),
    "depth": (nested(MAX_DEPTH + 1), f"deeper than {MAX_DEPTH}"),
    "side-by-side": ({"type": "object", "properties": {f"p{i}": ints(maxItems=MAX_REPEAT) for i in range(50)}},
                     f"more than the {MAX_GRAMMAR_CHARS}"),
    "allOf-copies": ({"$defs": {"D": {"type": "object", "properties": {"x": ints(maxItems=1000)}}},
                      "properties": {f"p{i}": {"allOf": [{"$ref": "#/$defs/D"}]} for i in range(100)}},
                     "characters"),
    "const": ({"const": "x" * MAX_GRAMMAR_CHARS}, "characters"),
}


@pytest.mark.parametrize("name", OVER)
def test_a_schema_over_the_budget_is_refused_naming_its_field_and_the_limit(name: str) -> None:
    schema, limit = OVER[name]
    with pytest.raises(SchemaTooLarge, match=r".") as refused:
        check_schema(schema, "response_format.json_schema.schema")
    assert refused.value.param == "response_format.json_schema.schema"
    assert limit in str(refused.value)


def test_tools_are_counted_and_measured_one_by_one_and_together() -> None:
    small = {"type": "object", "properties": {"values": ints(maxItems=900)}}
    with pytest.raises(SchemaTooLarge) as many:
        check_tools([FunctionTool(f"f{i}", param=f"tools[{i}].function") for i in range(MAX_TOOLS + 1)])
    assert many.value.param == "tools"
    with pytest.raises(SchemaTooLarge) as one:
        check_tools([FunctionTool("f", param="tools[0].function"),
                     FunctionTool("g", ints(maxItems=10**9), param="tools[1].function")])
    assert one.value.param == "tools[1].function.parameters"
    with pytest.raises(SchemaTooLarge) as together:
        check_tools([FunctionTool(f"f{i}", small, param=f"tools[{i}].function") for i in range(MAX_TOOLS)])
    assert together.value.param == "tools"
    check_tools([FunctionTool(f"f{i}", small, param=f"tools[{i}].function") for i in range(8)])


# --- real schemas: what the clients send ---------------------------------------------------------

class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


Country = enum.Enum("Country", {f"C{i}": f"country-{i}" for i in range(250)})  # an enum of a few hundred


class Address(BaseModel):
    street: str = Field(max_length=200)
    city: str
    country: Country
    postcode: Optional[str] = Field(default=None, pattern=r"^[0-9]{4,6}$")


class LineItem(BaseModel):
    sku: str = Field(min_length=3, max_length=32)
    quantity: int = Field(ge=1, le=1000)
    tags: list[str] = Field(default_factory=list, max_length=10)


class Order(BaseModel):
    """A nested model of the kind instructor and pydantic-ai extract into."""

    id: str
    status: Literal["open", "paid", "shipped", "cancelled"]
    color: Color
    shipping: Address
    billing: Optional[Address] = None
    items: list[LineItem] = Field(min_length=1, max_length=50)
    notes: dict[str, str] = Field(default_factory=dict)
    history: list[tuple[str, float]] = Field(default_factory=list)


class Tree(BaseModel):
    """A recursive model: its schema refers to itself."""

    name: str
    children: list["Tree"] = Field(default_factory=list)


def ship(order_id: str, address: Address, express: bool = False) -> str:
    """Ship an order."""
    return order_id


def search(query: str, limit: int = 10, colors: Optional[list[Color]] = None) -> list[str]:
    """Search the catalogue."""
    return []


REAL = {
    "pydantic-order": Order.model_json_schema(),
    "pydantic-tree": Tree.model_json_schema(),
    "openai-strict-order": to_strict_json_schema(Order),
    "openai-strict-tree": to_strict_json_schema(Tree),
    "agents-tool-ship": agents.function_tool(ship).params_json_schema,
    "agents-tool-search": agents.function_tool(search).params_json_schema,
    "agents-output-order": agents.AgentOutputSchema(Order, strict_json_schema=False).json_schema(),
    "agents-output-items": agents.AgentOutputSchema(list[LineItem]).json_schema(),
    "enum-of-300": {"type": "string", "enum": [f"value-{i}" for i in range(300)]},
    "list-of-200": ints(minItems=1, maxItems=200),
    "nesting-at-the-limit": nested(MAX_DEPTH - 1),
}


# A model whose root refers to itself: the pinned converter cannot resolve the root's own $ref.
CONVERTER_REFUSES = {"pydantic-tree"}


@pytest.mark.parametrize("name", REAL)
def test_real_schemas_fit_the_budget_and_compile(model: Model, name: str) -> None:
    schema = REAL[name]
    estimate = check_schema(schema, "response_format.json_schema.schema")
    if name in CONVERTER_REFUSES:
        with pytest.raises(KeyError):  # the pinned converter's own limit (a 400 naming response_format)
            json_gbnf(schema)
        return
    gbnf = json_gbnf(schema)  # as served
    assert len(gbnf) <= estimate
    Sampler(model, SamplingParams(temperature=0.0, grammar=gbnf)).close()


# --- generated schemas, through the request path ------------------------------------------------

BOUNDS = st.one_of(st.sampled_from([0, 1, 3, 50, 999, 1000, MAX_REPEAT, MAX_REPEAT + 1, 10**9, 10**12]),
                   st.integers(-3, 3000), st.sampled_from([1e9, 2.5, "7", None, True, float("inf"), float("nan")]))
PATTERNS = st.sampled_from(["^a{3}$", "^[a-z]{1,900}$", "^(ab)*c?$", "^(a?){40}$", "^(a?){8}$", "^((ab){4}c){4}$", "^.{0,10000000}$", "^x{99999}$",
                            "^[0-9]{2,4}-[0-9]+$", "abc", "^(a|b)+$", "^\\d{3}$"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=8))
NAMES = st.text(st.characters(codec="ascii", categories=["L", "N", "Pd"]), min_size=1, max_size=12)


def _bounded(keys: tuple[str, ...]) -> st.SearchStrategy[dict]:
    return st.dictionaries(st.sampled_from(keys), BOUNDS, max_size=2)


LEAVES = st.one_of(
    st.builds(lambda b: {"type": "string", **b}, _bounded(("minLength", "maxLength"))),
    st.builds(lambda p: {"type": "string", "pattern": p}, PATTERNS),
    st.sampled_from([{"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}, {},
                     {"type": "string", "format": "date"}, {"type": ["string", "null"]}]),
    st.builds(lambda values: {"enum": values}, st.lists(SCALARS, min_size=1, max_size=6)),
    st.builds(lambda size: {"enum": [f"v{i}" for i in range(size)]}, st.sampled_from([300, MAX_ALTERNATIVES + 1])),
    st.builds(lambda value: {"const": value}, SCALARS),
)


def _containers(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.one_of(
        st.builds(lambda item, b: {"type": "array", "items": item, **b}, children, _bounded(("minItems", "maxItems"))),
        st.builds(lambda props, extra: {"type": "object", "properties": props, "required": list(props)[:1],
                                        "additionalProperties": extra},
                  st.dictionaries(NAMES, children, max_size=4), st.one_of(st.booleans(), children)),
        st.builds(lambda alts: {"anyOf": alts}, st.lists(children, min_size=1, max_size=3)),
        st.builds(lambda items: {"type": "array", "prefixItems": items}, st.lists(children, min_size=1, max_size=3)),
        st.builds(lambda d: {"$defs": {"D": d}, "type": "object",
                             "properties": {"a": {"$ref": "#/$defs/D"}, "b": {"allOf": [{"$ref": "#/$defs/D"}]}}},
                  children),
    )


SCHEMAS = st.recursive(LEAVES, _containers, max_leaves=12)


@pytest.fixture(scope="module")
def template(model: Model) -> ChatTemplate:
    return ChatTemplate.from_model(model)


def _served(model: Model, template: ChatTemplate, body: dict) -> SamplingParams:
    """The sampling a chat body gets, grammar compiled, or the APIError it is refused with."""
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    tools = prompts.chat_tools(model, prompts.detect_format(template.source), request)
    return prompts.chat_sampling(model, request, prompts.ChatPrompt([], [], tools))


@given(schema=SCHEMAS, as_tool=st.booleans())
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_generated_schema_is_a_400_naming_its_field_or_a_grammar_that_compiles(
        model: Model, template: ChatTemplate, schema: dict, as_tool: bool) -> None:
    if as_tool:
        body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                "tool_choice": "required"}
        field = "tools"
    else:
        body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        field = "response_format"
    try:
        params = _served(model, template, body)
    except APIError as refused:
        event("refused: schema budget" if "allowed" in refused.body["error"]["message"] else "refused: other")
        assert refused.status == 400
        assert (refused.body["error"]["param"] or "").startswith(field), refused.body
        return
    event("compiled")
    assert params.grammar and len(params.grammar) <= MAX_GRAMMAR_CHARS
    if not as_tool:  # the estimate bounds what the converter wrote
        assert len(params.grammar) <= check_schema(schema, "x")


@pytest.mark.parametrize("pattern", [
    r"^(\d{1,3}\.){3}\d{1,3}$", r"^[\w.+-]+@[\w-]+(\.[\w-]+)+$", r"^(\+\d{1,2}\s?)?\(?\d{3}\)?[\s.-]?\d{3}[\s.-]?\d{4}$",
    r"^\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}(:\d{2})?)?$", r"^v?(\d+\.){2}\d+(-[a-z0-9.]+)?$", r"^(a?b?){16}$",
    r"^(?:[A-Z]{2}-){0,3}[A-Z]{2}$",
])
def test_everyday_patterns_fit(pattern: str) -> None:
    check_schema({"type": "string", "pattern": pattern}, "response_format.json_schema.schema")
