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
    return SimpleNamespace(share_key=share_key, weights_bytes=weights, kv_bytes=kv, extra_bytes=extra,
                           sleep=None)  # HostSlot.sleep: awake (actors/worker/host_sleep.py)


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


class _Svc:
    def __init__(self) -> None:
        self.draining, self.live, self._adds = False, {}, []

    async def _publish_credits(self) -> None:
        pass


def _live_slot(share_key: str, weights: int, kv: int, extra: int = 0):
    slot = _slot(share_key, weights, kv, extra)
    slot.svc, slot.resize_to = _Svc(), 0
    slot.idle = lambda: not slot.svc.live
    return slot


@pytest.mark.asyncio
async def test_short_of_room_it_pauses_oversized_caches_first_then_evicts_the_least_valuable_idle_version():
    """The plan said a version fits, the bytes held say otherwise (a first load estimated from the manifest,
    LoRA slots): a host must not wait forever (found by a fresh-user trial: the default model never came back)."""
    from actors.worker.residency import Demand

    host = _host({"a@1": {"artifact": "/m/a.gguf"}, "b@1": {"artifact": "/m/b.gguf"},
                  "c@1": {"artifact": "/m/c.gguf", "memory_bytes": 30 * MiB}})
    for ref in ("a@1", "b@1", "c@1"):
        await host.ask(ref, 1)
    host.slots = {"a@1": _live_slot(host.spec("a@1").share_key, 40 * MiB, 30 * MiB, extra=2 * MiB),
                  "b@1": _live_slot(host.spec("b@1").share_key, 10 * MiB, 10 * MiB)}
    evicted = []

    async def evict(ref, forced, why):
        evicted.append((ref, forced, why))
    host._evict = evict
    specs = {r: host.spec(r) for r in ("a@1", "b@1", "c@1")}
    demand = {"a@1": Demand(tokens_per_s=50.0), "b@1": Demand(), "c@1": Demand(queue_len=1)}
    # a's cache is over its share and a request runs on it: it is paused for a resize (once idle), nothing is
    # evicted (the room is coming)
    host.slots["a@1"].svc.live = {"r": object()}
    await host._make_room("c@1", {"a@1": 20 * MiB, "b@1": 10 * MiB}, 30 * MiB, specs, demand, 0.0)
    assert host.slots["a@1"].resize_to == 18 * MiB and host.slots["a@1"].svc.draining and not evicted
    # nothing over its share and nothing pausing: the least valuable idle version goes
    host.slots["a@1"].resize_to, host.slots["a@1"].svc.draining, host.slots["a@1"].svc.live = 0, False, {}
    await host._make_room("c@1", {"a@1": 40 * MiB, "b@1": 10 * MiB}, 30 * MiB, specs, demand, 10.0)
    assert [e[0] for e in evicted] == ["b@1"] and "making room for c@1" in evicted[0][2] and not evicted[0][1]


def test_rank_hosts_prefers_a_holder_then_free_bytes():
    from actors.scheduler.host_ask import rank_hosts

    hosts = {"a": {"free_bytes": 10, "resident": []}, "b": {"free_bytes": 50, "resident": []},
             "c": {"free_bytes": 1, "resident": [{"model": "m@1"}]}, "d": {"free_bytes": 0, "asked": ["m@2"]},
             "junk": "not a record"}
    assert rank_hosts(hosts, "m@1") == ["c", "b", "a", "d"]
    assert rank_hosts(hosts, "m@2") == ["d", "b", "a", "c"]
    assert rank_hosts({}, "m@1") == []
