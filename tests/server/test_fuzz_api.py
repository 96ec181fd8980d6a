"""Schema-driven fuzzing of the live API with schemathesis: every operation of /openapi.json gets
bodies, paths and queries generated from its schema (valid and not), sent with a key to the real
server with the real model. Checks: no 5xx, every status and content type documented, every
response body matching its schema; the server is alive and healthy after.

Default run: a bounded budget per operation (FUZZ_EXAMPLES); `-m slow`: ten times as many.
Generated max_tokens (Ollama's options.num_predict) are clamped to 4 so that the budget goes to
breadth, not to decoding.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

FUZZ_EXAMPLES = 60
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def fuzz(server, examples: int) -> dict[str, dict[int, int]]:
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    headers = {"Authorization": f"Bearer {server.keys['fuzz']}"}
    seen: dict[str, dict[int, int]] = {}
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 15
    for op in operations:
        codes = seen.setdefault(op.label, {})

        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case) -> None:
            if isinstance(case.body, dict):
                for k in ("max_tokens", "max_completion_tokens"):
                    if isinstance(case.body.get(k), int) and case.body[k] > 4:
                        case.body[k] = 4
                if case.operation.path in ("/api/chat", "/api/generate"):   # Ollama: options.num_predict
                    opts = case.body.get("options")
                    case.body["options"] = {**(opts if isinstance(opts, dict) else {}), "num_predict": 4}
            r = case.call_and_validate(base_url=server.base_url, headers=headers, checks=CHECKS, timeout=120)
            codes[r.status_code] = codes.get(r.status_code, 0) + 1  # noqa: B023 - run() is called in this iteration

        run()
    return seen


def check_alive(server) -> None:
    assert server.proc.poll() is None
    assert httpx.get(server.base_url + "/health", timeout=60).json()["status"] == "ok"
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=300,
                   headers={"Authorization": f"Bearer {server.keys['fuzz']}"},
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_fuzz_every_operation(hardened_server):
    seen = fuzz(hardened_server, FUZZ_EXAMPLES)
    # the fuzzer reached past validation: generation and tokenization answered 200 at least once
    assert seen["POST /v1/completions"].get(200) and seen["POST /tokenize"].get(200), seen
    assert not any(code >= 500 for codes in seen.values() for code in codes)
    check_alive(hardened_server)


@pytest.mark.slow
def test_fuzz_every_operation_long(hardened_server):
    fuzz(hardened_server, FUZZ_EXAMPLES * 10)
    check_alive(hardened_server)
