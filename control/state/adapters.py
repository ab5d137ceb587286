"""LoRA adapter records in the registry (pure: no torch, no etcd I/O).

An adapter is registered for one model version at ``/actorserve/models/{name}/adapters/{adapter}``
(control/state/names.py ``adapter_key``)::

    {"adapter": "sql", "model": "smollm2", "version": "1", "path": "/abs/dir", "tenants": ["acme"],
     "rank": 16, "alpha": 32.0, "status": "active" | "retired", "created": epoch s, "retired_at": epoch s,
     "revision": "3fa2c1d0"}

``revision`` is new at every ``register``: downstream of the gateway an adapter is named by its *id*
``adapter~revision`` (``adapter_id``), so re-registering a name (another directory, or the same directory
with new files) makes workers read the files again and never lets the prefix cache serve blocks computed with
the old weights (the cache salt covers the id).

``tenants`` empty = every tenant allowed on the model; otherwise only those (others get the 404 of an unknown
model).  ``path`` is a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``) that every
worker of the version can read; workers read it lazily, on the first request that names the adapter.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid

from control.state.names import validate_name

STATUSES = ("active", "retired")
#: PEFT options the engine cannot serve (actors/worker/engine/lora.py refuses them too), with the value it serves
UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
               "rank_pattern": None, "alpha_pattern": None}
_TENSOR = re.compile(r"layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.lora_[AB]\.weight$")


def check_peft_dir(path: str) -> dict:
    """``{"rank", "alpha"}`` of a PEFT LoRA directory; ValueError naming the file or field that is wrong (missing
    directory or files, unreadable JSON, a peft_type other than LORA, a bad ``r``). The tensors are checked by
    the worker against the model (actors/worker/engine/lora.py), where a bad one fails only its requests."""
    if not os.path.isdir(path):
        raise ValueError(f"--path {path!r} is not a directory")
    cfg_file, weights = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
    try:
        with open(cfg_file, "rb") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{cfg_file}: unreadable ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_file}: peft_type must be LORA")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{cfg_file}: r must be an integer >= 1")
    for key, served in UNSUPPORTED.items():
        if (cfg.get(key) or served) != served:
            raise ValueError(f"{cfg_file}: {key}={cfg[key]!r} is not supported")
    if not os.path.isfile(weights):
        raise ValueError(f"{weights}: missing (only safetensors adapters are served)")
    _check_tensor_names(weights)
    return {"rank": r, "alpha": float(cfg.get("lora_alpha", r))}


def _check_tensor_names(weights: str) -> None:
    """ValueError when the safetensors header is unreadable, holds no tensor, or names a tensor that is not a LoRA
    A/B of an attention or MLP projection (embeddings, lm_head). Shapes are checked by the worker."""
    from safetensors import safe_open

    try:
        with safe_open(weights, framework="numpy") as f:
            keys = list(f.keys())
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise ValueError(f"{weights}: unreadable ({e})") from None
    bad = [k for k in keys if not _TENSOR.search(k)]
    if not keys or bad:
        raise ValueError(f"{weights}: " + (f"tensor {bad[0]!r} is not a LoRA A/B of an attention or MLP projection"
                                           if bad else "holds no tensor"))


def adapter_record(adapter: str, model: str, version: str, path: str, tenants: list[str] | tuple = (),
                   rank: int = 0, alpha: float = 0.0, now: float | None = None) -> dict:
    """A new active adapter record (ValueError for a bad name, version, tenant or a relative path)."""
    validate_name("adapter name", adapter)
    validate_name("model name", model)
    validate_name("model version", version)
    for t in tenants:
        validate_name("tenant", t)
    if not os.path.isabs(path):
        raise ValueError(f"path {path!r} must be absolute (workers read it)")
    return {"adapter": adapter, "model": model, "version": version, "path": path, "tenants": sorted(set(tenants)),
            "rank": int(rank), "alpha": float(alpha), "status": "active",
            "created": time.time() if now is None else now, "revision": uuid.uuid4().hex[:8]}


def adapter_id(record: dict) -> str:
    """How requests, schedulers and workers name an adapter: ``adapter~revision`` (``adapter`` for a record
    without a revision). ``~`` is outside the name alphabet, so an id never equals another adapter's name."""
    rev = record.get("revision")
    return f"{record['adapter']}~{rev}" if rev else str(record["adapter"])


def display_name(adapter_id_: str) -> str:
    """The adapter name of an id (``sql~3fa2c1d0`` -> ``sql``)."""
    return adapter_id_.split("~", 1)[0]


def retired(record: dict, now: float | None = None) -> dict:
    """The record marked retired (its requests answer 404; workers drop it once no request uses it)."""
    return {**record, "status": "retired", "retired_at": time.time() if now is None else now}


def is_active(record: dict | None) -> bool:
    """True for a record whose status is active."""
    return isinstance(record, dict) and record.get("status", "active") == "active"


def visible_to(record: dict | None, tenant: str | None) -> bool:
    """True when ``tenant`` may use the adapter (active, and either no tenant list or ``tenant`` on it).
    ``tenant`` None = no tenancy (every active adapter)."""
    if not is_active(record):
        return False
    tenants = record.get("tenants") or []
    return tenant is None or not tenants or tenant in tenants


def served_by(records: dict[str, dict], version: str) -> dict[str, str]:
    """``{adapter id: path}`` of the active adapters of one model registered for ``version`` (a worker's set)."""
    return {adapter_id(r): r["path"] for r in records.values()
            if is_active(r) and r.get("version") == version and r.get("path")}
