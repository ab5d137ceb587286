"""``GET /openapi.json`` and a bounded schemathesis run against a stack serving the tiny random model.

The stack caps ``max_tokens`` (4), ``n`` (2) and n x prompts (4) so every generated request is cheap;
schemathesis runs its examples, coverage and fuzzing phases with a bounded example count per
operation and must find no 5xx and no response that violates the document.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.helpers import tiny_deployment


@pytest.fixture(scope="module")
def tiny_stack(tmp_path_factory, tiny_gguf):
    with tiny_deployment(tmp_path_factory.mktemp("fuzz-state"), tiny_gguf, {
            "worker": ["--kv-cache-bytes", "8000000", "--no-progress"],
            "validator": ["--max-tokens-cap", "4", "--max-n", "2", "--max-choices", "4"]}) as sup:
        yield sup


def test_openapi_document(tiny_stack):
    doc = httpx.get(tiny_stack.http_url + "/openapi.json", timeout=10).json()  # public: no key needed
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/healthz", "/readyz"}
    chat = doc["components"]["schemas"]["ChatCompletion"]
    assert set(chat["required"]) >= {"id", "object", "created", "model", "choices"}
    model = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"][
        "properties"]["model"]
    assert "tiny" in model["enum"]


def test_schemathesis_finds_no_5xx_and_no_schema_violation(tiny_stack, tmp_path):
    exe = Path(sys.executable).with_name("schemathesis")
    if not exe.exists():
        pytest.skip("schemathesis is not installed (test extra)")
    report = tmp_path / "report.json"
    cmd = [str(exe), "run", tiny_stack.http_url + "/openapi.json",
           "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                       "response_schema_conformance",
           "--max-examples", "25", "--phases", "examples,coverage,fuzzing", "--seed", "4",
           "--request-timeout", "30", "--no-shrink", "--report", "ndjson", "--report-ndjson-path", str(report)]
    key = getattr(tiny_stack, "dev_api_key", None)  # once API keys are enforced, fuzz as an authenticated client
    if key:
        cmd += ["--header", f"Authorization: Bearer {key}"]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    elapsed = time.time() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    m = re.search(r"(\d+) generated", out)
    print(f"schemathesis: {elapsed:.1f} s; {m.group(0) if m else 'count n/a'}\n{out[-1500:]}")
    assert elapsed < 120, "the fuzz run must stay bounded"
