"""Bad input at scale: schemathesis generates requests from /openapi.json against a real server.

Bounded: a fixed number of examples per operation, a server with tight limits (so a valid random
request stays cheap), loopback only. No response may be a 5xx or violate the documented schema.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.serverproc import ServerProcess


@pytest.fixture(scope="module")
def fuzz_server(tiny_flux_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("fuzz")
    server = ServerProcess(
        [
            "--model-path",
            str(tiny_flux_path),
            "--max-image-side",
            "64",
            "--max-inference-steps",
            "2",
            "--max-prompt-chars",
            "200",
        ],
        logs / "server.log",
    )
    server.start()
    yield server
    server.stop()


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_api_never_5xx_and_matches_schema(fuzz_server: ServerProcess):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/images/generations", "/v1/images/edits", "/v1/models/{model_id}"} <= paths, paths
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            response = case.call(timeout=60)
            case.validate_response(response, checks=CHECKS)

        check()
    # The server is still healthy after the barrage.
    assert httpx.get(f"{fuzz_server.base_url}/health").status_code == 200
