"""A bounded schemathesis pass over the app's own OpenAPI schema, on SQLite and PostgreSQL.

No 5xx, every status, header and body as documented, invalid input rejected. Kept to a few seconds
for ``make test``; ``bench/api_fuzz.py`` runs the long version against a live server.

The operations are driven through ``APIOperation.as_strategy`` inside an ordinary test, rather than
schemathesis' pytest plugin, so that the database fixture (both backends) works as everywhere else.
"""

from __future__ import annotations

import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from autotune_server import Settings, create_app
from tests.factories import profile_payload
from tests.server.conftest import WRITE, WRITE_TOKEN

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
]
EXAMPLES_PER_OPERATION_AND_MODE = 25


def _fuzz(operation: schemathesis.APIOperation, mode: GenerationMode) -> int:
    calls = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES_PER_OPERATION_AND_MODE,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case) -> None:
        nonlocal calls
        calls += 1
        case.call_and_validate(headers=WRITE, checks=CHECKS)

    try:
        run()
    except Unsatisfiable:
        # Nothing to make invalid (no parameters, no body): only the positive pass applies.
        if mode is GenerationMode.POSITIVE:
            raise
    return calls


def test_api_conforms_to_its_schema(database_url: str) -> None:
    app = create_app(
        Settings(
            database_url=database_url, api_tokens=(WRITE_TOKEN,), max_body_bytes=256 * 1024, access_log=False
        )
    )
    with TestClient(app) as client:
        # Something stored, so that reads and /suggest also take their found paths.
        assert client.post("/api/v1/profiles", json=profile_payload(), headers=WRITE).status_code == 201
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        operations = [result.ok() for result in schema.get_all_operations()]
        labels = {op.label for op in operations}
        assert {
            "POST /api/v1/profiles",
            "GET /api/v1/suggest",
            "DELETE /api/v1/profiles/{profile_id}",
        } <= labels
        calls = 0
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                calls += _fuzz(operation, mode)
    assert calls >= len(operations)  # the pass really sent requests
