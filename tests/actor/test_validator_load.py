"""The validator's load report (actors/load_report.py wired in actors/validator/service.py) and its test-only
delay fault (actors/validator/faults.py) on the in-memory bus: held requests show as backlog and queue wait."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.validator.faults import ValidatorDelay
from actors.validator.service import ValidatorService
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import ApiRequest
from tests.engine_fixtures import write_tiny_llama_gguf


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama_gguf(str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


class Registry:
    def __init__(self, manifest: dict) -> None:
        self.manifest = manifest

    async def get_model_version(self, name: str, version: str) -> dict | None:
        return self.manifest


async def run(tiny_path, fault, n: int) -> tuple[ValidatorService, list[int], list[str]]:
    """Send ``n`` requests at once; return the service, the backlog seen while they wait, what was submitted."""
    bus = MemoryBus()
    svc = ValidatorService(bus, Registry({"artifact": tiny_path, "format": "gguf"}), fault=fault, actor_id="v-test")
    await svc.start()
    submitted: list[str] = []

    async def sched(msg):
        submitted.append(msg.data.decode())
        await msg.respond(b'{"accepted":true}')
    await bus.subscribe(subjects.sched_submit("m", "1"), sched)
    now = time.time()
    for i in range(n):
        req = ApiRequest(f"r{i}", "t", "m", "m", "1", "completions", {"model": "m", "prompt": "hi", "max_tokens": 2},
                         "_INBOX.t.r", deadline=now + 30, marks={"gateway_out": now})
        await bus.request(subjects.VALIDATE, req.encode(), 2.0)
    backlog = []
    for _ in range(200):
        backlog.append(svc._backlog())
        if len(submitted) >= n:
            break
        await asyncio.sleep(0.01)
    await svc.stop()
    return svc, backlog, submitted


async def test_delay_fault_serialises_requests_and_shows_as_wait_and_backlog(tiny_path):
    svc, backlog, submitted = await run(tiny_path, ValidatorDelay(100.0), 3)
    assert len(submitted) == 3 and svc.fault.held == 3
    assert max(backlog) >= 2  # while the first is held, the other two wait
    fig = svc.load.window.close(time.monotonic(), time.process_time())
    assert fig["handled"] == 3
    assert fig["wait_ms_p90"] >= 190.0  # the third waited for two holds of 100 ms
    assert svc._backlog() == 0


async def test_without_the_fault_waits_are_short(tiny_path):
    svc, _, submitted = await run(tiny_path, None, 2)
    fig = svc.load.window.close(time.monotonic(), time.process_time())
    assert len(submitted) == 2 and fig["handled"] == 2 and fig["wait_ms_p90"] < 1000.0
