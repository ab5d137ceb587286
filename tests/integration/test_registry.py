import asyncio
import time
import uuid

import pytest

from control.state import names
from control.state.registry import ModelManifest, Registry, parse_etcd_url


def _uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


MANIFEST = {
    "artifact": "/models/smollm2.gguf",
    "format": "gguf",
    "quantization": "Q4_1",
    "context_length": 8192,
    "memory_bytes": 100_000_000,
    "tokenizer": "gguf",
    "chat_template": "gguf",
    "defaults": {"temperature": 0.7, "top_p": 0.9, "max_tokens": 256, "stop": ["</s>"]},
}


def test_manifest_validation():
    m = ModelManifest.from_dict({"name": "m", "version": "v1", **MANIFEST, "note": "kept"})
    assert m.to_dict()["note"] == "kept"
    assert ModelManifest.from_dict(m.to_dict()) == m
    with pytest.raises(ValueError, match="format safetensors is not supported yet"):
        ModelManifest("m", "v1", "/x", format="safetensors")
    with pytest.raises(ValueError, match="context_length"):
        ModelManifest("m", "v1", "/x", context_length=0)
    with pytest.raises(ValueError, match="defaults.temprature"):
        ModelManifest("m", "v1", "/x", defaults={"temprature": 1.0})
    for key, bad in (("min_p", 2), ("repetition_penalty", -1)):  # honoured by the engine, checked like the wire
        assert ModelManifest("m", "v1", "/x", defaults={key: 0.1}).defaults == {key: 0.1}
        with pytest.raises(ValueError, match=f"defaults.{key} must be a number"):
            ModelManifest("m", "v1", "/x", defaults={key: bad})
    with pytest.raises(ValueError, match="defaults.top_p must be a number"):
        ModelManifest("m", "v1", "/x", defaults={"top_p": 0})
    with pytest.raises(ValueError, match="missing"):
        ModelManifest.from_dict({"name": "m"})
    with pytest.raises(ValueError):
        ModelManifest("M", "v1", "/x")


def test_parse_etcd_url():
    assert parse_etcd_url("http://127.0.0.1:2379") == ("127.0.0.1", 2379)
    assert parse_etcd_url("127.0.0.1:1,127.0.0.1:2") == ("127.0.0.1", 1)
    with pytest.raises(ValueError):
        parse_etcd_url("http://127.0.0.1")


async def test_manifest_roundtrip(registry):
    name = _uniq("m")
    stored = await registry.put_model_version(name, "v1", MANIFEST)
    got = await registry.get_model_version(name, "v1")
    assert got == stored.to_dict()
    assert got["name"] == name and got["version"] == "v1" and got["status"] == "active"
    assert await registry.get_manifest(name, "v1") == stored
    await registry.put_model_version(name, "v2", {**MANIFEST, "context_length": 2048})
    models = await registry.list_models()
    assert set(models[name]) == {"v1", "v2"}
    assert models[name]["v2"]["context_length"] == 2048
    assert set(await registry.list_model_versions(name)) == {"v1", "v2"}

    await registry.put_routing(name, {"stable": "v1", "canary": "v2", "weight": 0.1})
    assert (await registry.get_routing(name))["canary"] == "v2"
    assert set((await registry.list_models())[name]) == {"v1", "v2"}  # routing key not a version

    assert await registry.delete_model_version(name, "v1") is True
    assert await registry.get_model_version(name, "v1") is None
    assert await registry.delete_model_version(name, "v1") is False


async def test_unsupported_format_refused(registry):
    name = _uniq("m")
    with pytest.raises(ValueError, match="format exl2 is not supported yet"):
        await registry.put_model_version(name, "v1", {**MANIFEST, "format": "exl2"})
    assert await registry.get_model_version(name, "v1") is None
    with pytest.raises(ValueError, match="does not match"):
        await registry.put_model_version(name, "v1", {**MANIFEST, "version": "v2"})


async def test_json_helpers_and_tenants(registry):
    t = _uniq("t")
    await registry.put_tenant(t, {"quotas": {"rpm": 10}})
    assert (await registry.get_tenant(t))["quotas"]["rpm"] == 10
    assert t in await registry.list_tenants()
    key = names.scheduler_key(_uniq("m"), "v1")
    assert await registry.put_if_absent(key, {"id": "a"}) is True
    assert await registry.put_if_absent(key, {"id": "b"}) is False
    assert await registry.get_json(key) == {"id": "a"}
    assert await registry.delete(key) is True


async def test_worker_lease_expires_without_keepalive(infra, registry):
    name, wid = _uniq("m"), _uniq("w")
    owner = await Registry.open(infra.etcd_url)
    try:
        lease = await owner.register_worker(name, "v1", wid, {"pool": "cpu"}, ttl=2)
        assert (await registry.list_workers(name, "v1")) == {wid: {"pool": "cpu"}}
        # Alive well past the TTL while the keepalive runs.
        await asyncio.sleep(3.0)
        assert wid in await registry.list_workers(name, "v1")
        assert lease.refreshes >= 2 and not lease.lost.is_set()
    finally:
        await owner.close()  # stops the keepalive without revoking, like a crash
    t0 = time.monotonic()
    while wid in await registry.list_workers(name, "v1"):
        assert time.monotonic() - t0 < 2 + 1, "worker key outlived its lease TTL + 1 s"
        await asyncio.sleep(0.1)


async def test_worker_lease_revoke_deletes_now(registry):
    name, wid = _uniq("m"), _uniq("w")
    lease = await registry.register_worker(name, "v1", wid, {"pool": "cpu"}, ttl=3)
    await lease.update({"pool": "gpu"})
    assert (await registry.list_workers(name, "v1"))[wid] == {"pool": "gpu"}
    await lease.revoke()
    assert await registry.list_workers(name, "v1") == {}
    with pytest.raises(ValueError):
        await registry.register_worker(name, "v1", wid, {}, ttl=10)


async def test_lease_lost_is_signalled(registry):
    name, wid = _uniq("m"), _uniq("w")
    lease = await registry.register_worker(name, "v1", wid, {}, ttl=1)
    # Revoke behind the keepalive's back: the next refresh learns the lease is gone.
    await registry.client.revoke_lease(lease.lease_id)
    await asyncio.wait_for(lease.lost.wait(), 3)
    assert not lease.active


async def test_watch_sees_put_and_delete(registry):
    prefix = names.model_prefix(_uniq("m"))
    await registry.put_json(prefix + "existing", {"n": 0})
    events: list = []
    got_all = asyncio.Event()

    async def consume():
        async for ev in registry.watch_prefix(prefix, include_existing=True):
            events.append(ev)
            if len(events) == 4:
                got_all.set()
                return

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.3)
    await registry.put_json(prefix + "a", {"n": 1})
    await registry.put_json(prefix + "a", {"n": 2})
    await registry.delete(prefix + "a")
    await asyncio.wait_for(got_all.wait(), 5)
    await task
    assert events == [
        ("put", prefix + "existing", {"n": 0}),
        ("put", prefix + "a", {"n": 1}),
        ("put", prefix + "a", {"n": 2}),
        ("delete", prefix + "a", None),
    ]


async def test_watch_survives_etcd_restart(tmp_path):
    from control.ops.embedded import EmbeddedEtcd

    etcd = EmbeddedEtcd(tmp_path)
    async with etcd:
        async with Registry.connect(etcd.url, timeout=2) as reg:
            seen: asyncio.Queue = asyncio.Queue()

            async def consume():
                async for ev in reg.watch_prefix("/actorserve/test/", retry_delay=0.1, max_retry_delay=0.5):
                    await seen.put(ev)

            task = asyncio.create_task(consume())
            try:
                await asyncio.sleep(0.3)
                await reg.put_json("/actorserve/test/x", 1)
                assert await asyncio.wait_for(seen.get(), 5) == ("put", "/actorserve/test/x", 1)
                await etcd.arestart()
                t0 = time.monotonic()
                while True:  # the client reconnects on its own; retry the write until it lands
                    try:
                        await reg.put_json("/actorserve/test/y", 2)
                        break
                    except Exception:
                        assert time.monotonic() - t0 < 15
                        await asyncio.sleep(0.2)
                assert await asyncio.wait_for(seen.get(), 15) == ("put", "/actorserve/test/y", 2)
            finally:
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task


async def test_worker_lease_survives_brief_etcd_restart(tmp_path):
    from control.ops.embedded import EmbeddedEtcd

    etcd = EmbeddedEtcd(tmp_path)
    async with etcd:
        async with Registry.connect(etcd.url, timeout=1) as reg:
            lease = await reg.register_worker("m", "v1", "w1", {"pool": "cpu"}, ttl=3)
            await etcd.arestart()  # etcd keeps leases across a restart and extends their TTL
            await asyncio.sleep(4)
            assert not lease.lost.is_set()
            assert "w1" in await reg.list_workers("m", "v1")
            await lease.revoke()
