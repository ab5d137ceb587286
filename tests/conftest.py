"""Shared fixtures.

``infra``: one embedded stack (real nats-server + etcd on loopback ports) for the whole session,
stopped at the end; tests stop only the processes it started (by recorded process group).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from control.ops.embedded import EmbeddedStack
from tests import gguf_cache

gguf_cache.install()  # share parsed GGUF readers of large model files in this process (tests/gguf_cache.py)


@dataclass(frozen=True)
class Infra:
    nats_url: str
    etcd_url: str
    state_dir: Path
    stack: EmbeddedStack


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def infra(tmp_path_factory: pytest.TempPathFactory):
    state_dir = tmp_path_factory.mktemp("actorserve-state")
    stack = EmbeddedStack(state_dir)
    async with stack:
        stack.write_endpoints()
        yield Infra(nats_url=stack.nats_url, etcd_url=stack.etcd_url, state_dir=state_dir, stack=stack)


@pytest_asyncio.fixture(loop_scope="session")
async def registry(infra):
    from control.state.registry import Registry

    async with Registry.connect(infra.etcd_url) as reg:
        yield reg
