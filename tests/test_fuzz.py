"""Schemathesis against kvserve's own /openapi.json: generated bodies, valid and invalid, for chat,
completions, responses (create, retrieve, delete), models, prefix match and the router routes (render,
tokenize, detokenize). No 5xx,
and every answer matches the status codes, content types and schemas the document promises
(errors in the OpenAI shape included)."""

from __future__ import annotations

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

FUZZED = r"^/(v1/(chat/completions|completions|responses|models|prefix/match)(/render|/\{response_id\})?|tokenize|detokenize)$"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


# The document is static: it comes from the app without loading a model.
schema = schemathesis.openapi.from_dict(create_app(Settings()).openapi()).include(path_regex=FUZZED)


@pytest.fixture(scope="module")
def base_url(tiny) -> Iterator[str]:
    # The smallest context bounds every generation, whatever max_tokens the fuzzer picks.
    with serve(tiny("llama"), threads=1, ctx_size=256, parallel=4) as url:
        yield url


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_openapi_fuzz(case: schemathesis.Case, base_url: str) -> None:
    case.call_and_validate(base_url=base_url, checks=CHECKS)
