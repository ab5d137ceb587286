"""The book-keeping of a multi-version worker host (actors/worker/host.py) without processes: what it asks the
residency policy (specs from measured or manifest bytes, shared weights once), which load asks it refuses, and
its byte counts. Loads, evictions and the scheduler's asks run for real in tests/e2e/test_model_host.py."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from actors.worker.host import ModelHost
from bus.host_messages import HostLoad, HostLoadAck

MiB = 2**20


class _Manifests:
    """The one registry read ``ModelHost.ask`` makes (``get_model_version``), from a dict."""

    def __init__(self, manifests: dict) -> None:
        self.manifests = manifests

    async def get_model_version(self, name: str, version: str):
        return self.manifests.get(f"{name}@{version}")


def _args(**kw) -> argparse.Namespace:
    base = dict(quantization="auto", dtype="auto", kv_floor_bytes=8 * MiB, kv_cache_bytes=32 * MiB, drain_bound=30.0,
                lease_ttl=3)
    return argparse.Namespace(**{**base, **kw})


def _slot(share_key: str, weights: int, kv: int, extra: int = 0):
    return SimpleNamespace(share_key=share_key, weights_bytes=weights, kv_bytes=kv, extra_bytes=extra)


def _host(manifests: dict, budget: int = 100 * MiB) -> ModelHost:
    return ModelHost(_Manifests(manifests), bus=None, host_id="h", args=_args(), budget_bytes=budget)


@pytest.mark.asyncio
async def test_asks_for_unknown_retired_or_oversized_versions_are_refused_with_the_reason():
    host = _host({"a@1": {"artifact": "/m/a.gguf", "memory_bytes": 10 * MiB},
                  "old@1": {"artifact": "/m/a.gguf", "status": "retired"},
                  "big@1": {"artifact": "/m/b.gguf", "memory_bytes": 95 * MiB}})
    ack = await host.ask("nope@1", 1)
    assert not ack.accepted and "not an active registered version" in ack.reason
    assert not (await host.ask("old@1", 1)).accepted
    big = await host.ask("big@1", 3)
    assert not big.accepted and big.reason == f"big@1 needs {103 * MiB} bytes; this host's budget is {100 * MiB}"
    ok = await host.ask("a@1", 4)
    assert ok.accepted and ok.reason == "queued for loading" and ok.free_bytes == 100 * MiB
    assert host.asks["a@1"][0] == 4 and set(host.asks) == {"a@1"}


@pytest.mark.asyncio
async def test_spec_uses_measured_bytes_then_the_manifest_and_a_resident_sharer_makes_loading_cheap():
    host = _host({"a@1": {"artifact": "/m/a.gguf", "memory_bytes": 10 * MiB},
                  "a@2": {"artifact": "/m/a.gguf", "memory_bytes": 10 * MiB},
                  "q@1": {"artifact": "/m/a.gguf", "quantization": "int8"}})
    for ref in ("a@1", "a@2", "q@1"):
        await host.ask(ref, 1)
    a1, a2, q = host.spec("a@1"), host.spec("a@2"), host.spec("q@1")
    assert a1.share_key == a2.share_key != q.share_key  # another quantization: another copy
    assert a1.weights_bytes == 10 * MiB and a1.load_cost_s == 5.0 and a1.kv_floor_bytes == 8 * MiB
    host.measured[a1.share_key] = (37 * MiB, 2.5)
    assert host.spec("a@2").weights_bytes == 37 * MiB and host.spec("a@2").load_cost_s == 2.5
    host.slots["a@1"] = _slot(a1.share_key, 37 * MiB, 32 * MiB)
    assert host.spec("a@2").load_cost_s == 0.1


def test_held_bytes_count_shared_weights_once_and_the_kv_cap():
    host = _host({})
    host.slots = {"a@1": _slot("k", 40 * MiB, 20 * MiB, extra=MiB), "a@2": _slot("k", 40 * MiB, 10 * MiB),
                  "b@1": _slot("j", 5 * MiB, 8 * MiB)}
    assert host.held_bytes() == 40 * MiB + 5 * MiB + 20 * MiB + MiB + 10 * MiB + 8 * MiB
    assert host.free_bytes() == 100 * MiB - host.held_bytes()
    assert host.kv_cap() == 32 * MiB
    host.slots["c@1"] = _slot("z", 60 * MiB, 0)
    assert host.free_bytes() == 0  # never negative


def test_load_messages_validate():
    assert HostLoad.decode(HostLoad("m", "1", 3).encode()) == HostLoad("m", "1", 3)
    with pytest.raises(ValueError, match="queue_len"):
        HostLoad("m", "1", -1)
    with pytest.raises(ValueError, match="version"):
        HostLoad.decode(b'{"name": "m"}')
    with pytest.raises(ValueError, match="name and version"):
        HostLoad.decode(b'{"name": "m", "version": ""}')
    assert HostLoadAck.decode(b'{"accepted": false, "reason": "x", "extra": 1}') == HostLoadAck(False, "x")


def test_measured_weights_survive_a_restart_until_the_artifact_changes(tmp_path):
    from actors.worker.host_measured import load_measured, save_measured

    art = tmp_path / "m.gguf"
    art.write_bytes(b"x" * 10)
    store = tmp_path / "cache" / "host_measured.json"
    save_measured({f"{art}|auto|auto": (123, 2.5), "/gone.gguf|auto|auto": (7, 1.0)}, store)
    assert load_measured(store) == {f"{art}|auto|auto": (123, 2.5)}  # a missing artifact's entry is dropped
    art.write_bytes(b"y" * 11)  # another file: measured again
    assert load_measured(store) == {}
    store.write_text("{not json")
    assert load_measured(store) == {}
