"""Prefix-cache salt: which requests may share cached KV blocks (pure: no torch, no nats).

A prompt's cached blocks are found by chained block hashes (vLLM's automatic prefix caching). Keyed by
token ids alone, a tenant can time another tenant's prompts: a prefix hit shortens TTFT, so probing with a
guessed prompt tells whether someone sent it (vLLM CVE-2025-46570). vLLM's answer is a ``cache_salt``
request field, and its follow-up (vllm-project/vllm#53347) notes the salt must come from the server: a
client can copy another tenant's salt. Here the salt is derived by the scheduler, never read from a
request body:

    salt = blake2b("v1" || model version || scope || adapter), 16 bytes
    scope = "group:<cache_group>" when the operator put the tenant in a cache-sharing group
            (tenant record ``cache_group``), else "tenant:<tenant id>"

It seeds the first block hash of the chain, both in the worker's block manager
(actors/worker/engine/block_manager.py) and in the scheduler's prefix-affinity index
(actors/scheduler/prefix_affinity.py), so equal hashes mean equal tokens *and* equal model version, scope
and adapter. Tenants in one group share hits; every other pair never does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

SALT_BYTES = 16


def cache_scope(tenant: str, cache_groups: Mapping[str, str]) -> str:
    """``"group:<g>"`` for a tenant in cache-sharing group ``g``, else ``"tenant:<tenant>"``."""
    group = cache_groups.get(tenant, "")
    return f"group:{group}" if group else f"tenant:{tenant}"


def cache_salt(model_ref: str, scope: str, adapter: str | None = None) -> bytes:
    """The 16-byte salt of requests to ``model_ref`` (``name@version``) in ``scope`` (``cache_scope``) with
    LoRA ``adapter`` (None = the base model)."""
    text = "\0".join(("v1", model_ref, scope, adapter or ""))
    return hashlib.blake2b(text.encode(), digest_size=SALT_BYTES).digest()


def tenant_cache_groups(tenants: Mapping[str, dict]) -> dict[str, str]:
    """Cache-sharing group per tenant id from tenant records (``cache_group``; tenants without one are left
    out: each is its own scope)."""
    out = {}
    for tid, rec in tenants.items():
        group = (rec or {}).get("cache_group") if isinstance(rec, dict) else None
        if isinstance(group, str) and group:
            out[tid] = group
    return out
