"""What ``actorserve up`` registers and shares with the actors it starts: the default model's manifest,
model registration (the first version of a name becomes stable), the dev tenant, the NATS tenant-user
sync, and small helpers for running a coroutine from the supervisor's threads."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from control.ops.artifacts import inspect_artifact
from control.ops.shipped_model import DEFAULT_MODEL_FILENAME, default_model_file  # noqa: F401 (re-exported)

log = logging.getLogger("actorserve.supervisor")

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_VERSION = "1"
DEFAULT_QUANTIZATION = "Q4_1"
DEFAULT_CONTEXT_LENGTH = 8192
DEFAULT_TOOL_CALL_FORMAT = "hermes"  # the default model's tool_call_format (actors/text/tool_calls.py)

# ---------------------------------------------------------------------------------------------
# model registration


def model_manifest(
    name: str = DEFAULT_MODEL_NAME,
    version: str = DEFAULT_MODEL_VERSION,
    model_file: str | os.PathLike[str] | None = None,
    *,
    context_length: int | None = None,
    quantization: str | None = None,
) -> dict[str, Any]:
    """The manifest dict to register for ``name@version``.

    Without ``model_file`` it is the shipped SmolLM2 GGUF (Q4_1, context 8192, tool calls in the
    ``hermes`` format). With one (``tool_call_format`` None: register it with ``--option`` to offer tools), the
    artifact is that path made absolute: a GGUF file (``format`` gguf, the file's vocabulary and chat template) or a
    Hugging Face directory (``format`` hf, its ``tokenizer.json`` and chat template), inferred and checked as
    ``models register`` does (control/ops/artifacts.py: the engine's spec must take the config and every tensor);
    the context length and quantization come from the artifact unless given. Raises FileNotFoundError if nothing
    is at the path, ValueError naming the file, field or tensor the engine would refuse.
    """
    if model_file is None:
        artifact, fmt = default_model_file(), "gguf"
        ctx, quant, size = DEFAULT_CONTEXT_LENGTH, DEFAULT_QUANTIZATION, os.path.getsize(artifact)
    else:
        artifact = str(Path(model_file).expanduser().resolve())
        if not os.path.exists(artifact):
            raise FileNotFoundError(f"model file {artifact} does not exist")
        facts = inspect_artifact(artifact)
        fmt, ctx, quant, size = facts.format, facts.context_length, facts.quantization, facts.memory_bytes
    manifest: dict[str, Any] = {
        "name": name,
        "version": version,
        "artifact": artifact,
        "format": fmt,
        "quantization": quantization or quant,
        "context_length": context_length or ctx,
        "memory_bytes": size,
        "tokenizer": fmt,  # gguf: the file's vocabulary; hf: the directory's tokenizer.json
        "chat_template": "gguf",  # from the artifact (the GGUF's, or the directory's template files)
        # the shipped SmolLM2 reads and writes Hermes tool calls (docs/tools.md); another file: unknown
        "tool_call_format": DEFAULT_TOOL_CALL_FORMAT if model_file is None else None,
    }
    return manifest


async def register_model(etcd_url: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Store ``manifest`` at ``/actorserve/models/{name}/versions/{version}`` through the registry; the
    version becomes the routing table's stable one if the table has none.

    Returns the stored manifest as a dict. Raises ValueError for an invalid manifest.
    """
    from control.state.registry import Registry

    async with Registry.connect(etcd_url) as reg:
        stored = await reg.put_model_version(str(manifest["name"]), str(manifest["version"]), manifest)
        await reg.ensure_stable(stored.name, stored.version)
    return stored.to_dict()


async def ensure_dev_tenant(etcd_url: str, state_dir: Path) -> str:
    """Create (or update) the development tenant ``dev``, allowed every registered model name, whose
    key is kept in ``<state_dir>/dev-api-key`` (created once, reused by later runs). Returns the key."""
    from control.state.registry import Registry
    from control.state.tenants import TenantAdmin

    async with Registry.connect(etcd_url) as reg:
        return await TenantAdmin(reg).ensure_dev_tenant(state_dir, sorted(await reg.list_models()))


async def _tenant_records(etcd_url: str) -> dict[str, Any]:
    from control.state.registry import Registry

    async with Registry.connect(etcd_url) as reg:
        return await reg.list_tenants()


def start_nats_user_sync(stack: Any) -> Any:
    """Keep the embedded nats-server's tenant users in step with etcd (bus/nats_auth.py); returns
    the running TenantUserSync (``stop()`` it)."""
    from bus.nats_auth import TenantUserSync

    return TenantUserSync(lambda: _run_coro(_tenant_records(stack.etcd_url)), stack.nats.set_tenant_users).start()


def _run_coro(coro: Any) -> Any:
    """Run ``coro`` to completion from sync code, even when this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(coro)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name="actorserve-register", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


def manifest_fingerprint(manifest: Mapping[str, Any]) -> str:
    """A stable digest of a manifest (all keys but ``status`` and ``pricing``, which only the gateways
    read, live: docs/budgets.md): a change means the version's processes must be restarted to pick it up."""
    data = {k: v for k, v in manifest.items() if k not in ("status", "pricing")}
    return json.dumps(data, sort_keys=True, default=str)


def version_worker_count(manifest: Mapping[str, Any], default: int) -> int:
    """Workers to run for a version: the manifest's extra key ``workers`` (an integer >= 0), else
    ``default``."""
    n = manifest.get("workers")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        return n
    if n is not None:
        log.warning("manifest of %s@%s: workers=%r is not an integer >= 0; using %d",
                    manifest.get("name"), manifest.get("version"), n, default)
    return default
