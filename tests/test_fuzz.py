"""Schemathesis against kvserve's own /openapi.json: generated bodies, valid and invalid, for chat,
completions, responses (create, retrieve, delete, list input items, cancel), Anthropic's messages
(and count_tokens), embeddings, models, prefix match and the router routes (render, tokenize,
detokenize). No 5xx,
and every answer matches the status codes, content types and schemas the document promises
(errors in the OpenAI shape, and in Anthropic's under /v1/messages, included). A second pass makes
every chat and messages body carry tools (with tool choices, parallel calls, arbitrary parameter
schemas and tool messages or blocks as generated) and serves them with a Hermes-style template,
whose lazy grammar and parser they then reach."""

from __future__ import annotations

import copy
from typing import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from conftest import serve
from kvserve.config import Settings
from kvserve.server.app import create_app

FUZZED = (r"^/(v1/(chat/completions|completions|responses|models|prefix/match|messages|embeddings)"
          r"(/render|/\{response_id\}(/input_items|/cancel)?|/count_tokens)?|tokenize|detokenize)$")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


# The document is static: it comes from the app without loading a model.
DOCUMENT = create_app(Settings()).openapi()
schema = schemathesis.openapi.from_dict(DOCUMENT).include(path_regex=FUZZED)


def _with_tools_required(document: dict) -> dict:
    """The document with `tools` in every chat and messages body, and a tool_call_id on every chat
    message (the document cannot say that only tool messages need one; most generated tool messages
    would lack it)."""
    document = copy.deepcopy(document)
    schemas = document["components"]["schemas"]
    schemas["ChatCompletionRequest"]["required"].append("tools")
    schemas["CreateMessage"]["required"].append("tools")
    schemas["Message"]["required"].append("tool_call_id")
    schemas["Message"]["properties"]["tool_call_id"] = {"type": "string", "minLength": 1}
    return document


tool_schema = schemathesis.openapi.from_dict(_with_tools_required(DOCUMENT)).include(
    path_regex=r"^/v1/(chat/completions|messages)$")


@pytest.fixture(scope="module")
def base_url(tiny) -> Iterator[str]:
    # The smallest context bounds every generation, whatever max_tokens the fuzzer picks.
    with serve(tiny("llama"), threads=1, ctx_size=256, parallel=4) as url:
        yield url


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_openapi_fuzz(case: schemathesis.Case, base_url: str) -> None:
    case.call_and_validate(base_url=base_url, checks=CHECKS)


@pytest.fixture(scope="module")
def hermes_url(tiny) -> Iterator[str]:
    with serve(tiny("llama", "hermes"), threads=1, ctx_size=512, parallel=4) as url:
        yield url


@tool_schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_openapi_fuzz_with_tools(case: schemathesis.Case, hermes_url: str) -> None:
    case.call_and_validate(base_url=hermes_url, checks=CHECKS)
