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

from control.ops.shipped_model import DEFAULT_MODEL_FILENAME, default_model_file  # noqa: F401 (re-exported)

log = logging.getLogger("actorserve.supervisor")

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_VERSION = "1"
DEFAULT_QUANTIZATION = "Q4_1"
DEFAULT_CONTEXT_LENGTH = 8192
DEFAULT_TOOL_CALL_FORMAT = "hermes"  # the default model's tool_call_format (actors/text/tool_calls.py)

# GGUF general.file_type codes (llama.cpp's LLAMA_FTYPE_*) for the common quantizations.
_GGUF_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 32: "BF16",
}


# ---------------------------------------------------------------------------------------------
# model registration


def check_gguf(path: str) -> None:
    """ValueError unless ``path`` starts with the GGUF magic ``b"GGUF"`` (GGUF spec, ggml docs/gguf.md)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ValueError(f"artifact {path} cannot be read: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise ValueError(f"artifact {path} is not a GGUF file (format gguf): it does not start with the GGUF magic")


def _gguf_facts(path: str) -> tuple[int | None, str | None]:
    """(context_length, quantization) from a GGUF's metadata; (None, None) if unreadable."""
    try:
        from actors.text.gguf_meta import read_gguf_metadata

        meta = read_gguf_metadata(path, full_arrays=())
    except Exception as e:  # the manifest can still name the file; the worker reports problems
        log.warning("could not read GGUF metadata of %s: %s", path, e)
        return None, None
    arch = meta.get("general.architecture")
    ctx = meta.get(f"{arch}.context_length") if arch else None
    ftype = meta.get("general.file_type")
    quant = _GGUF_FILE_TYPES.get(ftype) if isinstance(ftype, int) else None
    return (int(ctx) if isinstance(ctx, int) and ctx > 0 else None), quant


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
    artifact is that file's absolute path and the context length and quantization come from its
    GGUF metadata unless given. Raises FileNotFoundError if the file does not exist.
    """
    if model_file is None:
        artifact = default_model_file()
        ctx, quant = DEFAULT_CONTEXT_LENGTH, DEFAULT_QUANTIZATION
    else:
        artifact = str(Path(model_file).expanduser().resolve())
        if not os.path.isfile(artifact):
            raise FileNotFoundError(f"model file {artifact} does not exist")
        check_gguf(artifact)
        ctx, quant = _gguf_facts(artifact)
    manifest: dict[str, Any] = {
        "name": name,
        "version": version,
        "artifact": artifact,
        "format": "gguf",
        "quantization": quantization or quant,
        "context_length": context_length or ctx,
        "memory_bytes": os.path.getsize(artifact),
        "tokenizer": "gguf",
        "chat_template": "gguf",
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
