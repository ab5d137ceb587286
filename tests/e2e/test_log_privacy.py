"""Prompts and outputs are not logged by default (issue #8 item 8), even at DEBUG; with
``ACTORSERVE_LOG_PROMPTS=1`` they are, where docs/observability.md says (actors/content_log.py).

Runs a tiny-model stack with every actor at DEBUG, sends requests carrying a distinctive canary (chat,
streaming chat, completions, and invalid requests whose error echoes the value to the client), then
reads every file under ``<state-dir>/logs/``. Each actor runs as its NATS role (control/ops/nats_roles.py):
the logs must also hold no permission violation."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.e2e.helpers import tiny_deployment

CANARY = "zebra-canary-7781"


def _requests(sup) -> list[str]:
    """Send the canary through the stack; return the generated texts."""
    h = {"Authorization": f"Bearer {sup.dev_api_key}"}
    url = sup.http_url
    outputs = []
    with httpx.Client(timeout=60, headers=h) as c:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": f"Say {CANARY} please"}],
                "max_tokens": 8, "temperature": 0}
        r = c.post(f"{url}/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        outputs.append(r.json()["choices"][0]["message"]["content"])
        with c.stream("POST", f"{url}/v1/chat/completions", json={**chat, "stream": True}) as s:
            assert s.status_code == 200
            assert any(line.startswith("data: [DONE]") for line in s.iter_lines())
        r = c.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": f"{CANARY} is", "max_tokens": 8,
                                                   "temperature": 0})
        assert r.status_code == 200, r.text
        outputs.append(r.json()["choices"][0]["text"])
        # invalid requests: the answer may quote the bad value to the client, the logs must not
        for bad in ({**chat, "temperature": CANARY}, {**chat, "stop": 7, "user": CANARY},
                    {"model": "tiny", "messages": [{"role": CANARY, "content": CANARY}]},
                    {"model": f"{CANARY}", "messages": chat["messages"]}):
            r = c.post(f"{url}/v1/chat/completions", json=bad)
            assert 400 <= r.status_code < 500, r.text
        r = c.post(f"{url}/v1/chat/completions", content=b'{"model": "tiny", "messages": "' + CANARY.encode())
        assert r.status_code == 400
    return outputs


def _logs(sup) -> dict[str, str]:
    return {p.name: p.read_text(errors="replace") for p in Path(sup.logs_dir).glob("*.log")}


@pytest.mark.parametrize("opt_in", [False, True], ids=["default", "ACTORSERVE_LOG_PROMPTS=1"])
def test_prompts_and_outputs_stay_out_of_the_logs(tmp_path, tiny_gguf, opt_in):
    env = {"ACTORSERVE_LOG_PROMPTS": "1"} if opt_in else {"ACTORSERVE_LOG_PROMPTS": "0"}
    with tiny_deployment(tmp_path / "state", tiny_gguf, {"worker": ["--kv-cache-bytes", "8000000"]},
                         log_level="DEBUG", env=env) as sup:
        outputs = _requests(sup)
        logs = _logs(sup)
        connz = httpx.get(f"{sup.stack.nats.monitor_url}/connz?auth=1", timeout=5).json()
    users = {c.get("authorized_user") for c in connz["connections"]}
    # every actor connected as its role (control/ops/nats_roles.py), none as the operator user
    assert {f"actorserve-{r}" for r in ("gateway", "validator", "scheduler", "worker", "jobs", "control")} <= users
    assert "actorserve" not in users
    assert {"gateway-0.log", "validator-0.log", "worker-0.log", "scheduler-0.log"} <= set(logs)
    assert any("DEBUG" in text for text in logs.values())  # the actors really logged at DEBUG
    with_canary = sorted(name for name, text in logs.items() if CANARY in text)
    texts = [o for o in outputs if len(o.strip()) >= 12]
    with_output = sorted(name for name, text in logs.items() for o in texts if o in text)
    if opt_in:
        assert "gateway-0.log" in with_canary  # "request body of <id>: {...}" (docs/observability.md)
        assert "actorserve.content" in logs["validator-0.log"]  # prompt token ids
        assert "actorserve.content" in logs["worker-0.log"]  # output text
    else:
        assert with_canary == [], f"the prompt canary was logged in {with_canary}"
        assert with_output == [], f"generated text was logged in {with_output}"
        assert not any("actorserve.content" in text for text in logs.values())
    violations = {n: t.lower().count("permissions violation") for n, t in logs.items()}
    assert not any(violations.values()), json.dumps(violations)
