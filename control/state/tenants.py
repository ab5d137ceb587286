"""Tenants: records in etcd at ``/actorserve/tenants/{id}``, API keys, quotas, model allow-lists.

A tenant record (JSON object) holds::

    {"id": "acme", "created": 1700000000.0,
     "keys": {"k1a2b3c4d5e6": {"hash": "sha256:<hex>", "prefix": "sk-as-AbCd", "created": ..., "revoked": null}},
     "quotas": {"rpm": 100, "tpm": null, "concurrency": 4, "daily_tokens": null},   # null = unlimited
     "priority": "interactive", "weight": 1.0,
     "allowed_models": ["smollm2-135m-instruct"],                                  # [] = none
     "budget": {"usd": 25.0, "period": "month"}}                                   # null = no budget

A budget caps what the tenant's requests may cost per UTC day, UTC month or in total, at the model
versions' prices (manifest ``pricing``); gateways enforce it (gateway/budgets.py, docs/budgets.md).

API keys are ``sk-as-`` + 43 url-safe characters (256 random bits from ``secrets``). Only their SHA-256
is stored: a key has far too much entropy to be brute-forced from its hash, so a slow password hash
(bcrypt, argon2) would only cost latency on every request (docs/decisions/0008-tenancy.md). A revoked
key keeps its id and prefix (for audit) and loses its hash.

Every change is a compare-and-swap on the record's etcd mod_revision (:meth:`TenantAdmin.update`), so
two CLI invocations racing on one tenant never lose each other's edit. Gateways watch the prefix
(``gateway/auth.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from control.state import names
from control.policy.numbers import is_number

PRIORITY_CLASSES = ("interactive", "batch")
QUOTA_FIELDS = ("rpm", "tpm", "concurrency", "daily_tokens")
_GROUP_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a prefix-cache sharing group name (set_cache_group)
KEY_PREFIX = "sk-as-"
DEV_TENANT = "dev"
DEV_KEY_FILE = "dev-api-key"
DEV_NATS_USER_FILE = "dev-nats-user"  # NATS user name (= key id) of the dev key, for the NATS API
NATS_BCRYPT_COST = 10  # ~50 ms per NATS connect; the key itself has 256 random bits
BUDGET_PERIODS = ("day", "month", "total")  # UTC day, UTC calendar month, no reset
MAX_BUDGET_USD = 1e9  # sanity cap; micro-dollars stay exact in a float (< 2**53)


class TenantError(ValueError):
    """A tenant operation that cannot be done (unknown tenant or key, already exists, bad value)."""


def new_api_key() -> tuple[str, str]:
    """Return ``(key_id, api_key)``: a 12-hex-char public id and a fresh secret key (256 bits)."""
    return "k" + secrets.token_hex(6), KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(api_key: str) -> str:
    """``"sha256:<hex>"`` of an API key (what is stored and compared)."""
    return "sha256:" + hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def parse_bearer(header: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header value; None if absent or malformed."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        return None
    return token


@dataclass(frozen=True)
class Budget:
    """A tenant's spend budget: ``usd`` (USD, 0..MAX_BUDGET_USD) per ``period`` (BUDGET_PERIODS).
    ValueError naming the field otherwise."""

    usd: float
    period: str = "month"

    def __post_init__(self) -> None:
        if not is_number(self.usd) or not 0 <= self.usd <= MAX_BUDGET_USD:
            raise ValueError(f"budget.usd must be a number of USD between 0 and {MAX_BUDGET_USD:g}, got {self.usd!r}")
        if self.period not in BUDGET_PERIODS:
            raise ValueError(f"budget.period must be one of {', '.join(BUDGET_PERIODS)}, got {self.period!r}")

    @property
    def micro_usd(self) -> int:
        """The budget in integer micro-dollars (the unit of the spend records)."""
        return round(self.usd * 1_000_000)

    @classmethod
    def from_record(cls, rec: Any) -> "Budget | None":
        """From the record's ``budget`` value (None: no budget); ValueError if malformed."""
        if rec is None:
            return None
        if not isinstance(rec, Mapping):
            raise ValueError(f"budget must be an object {{usd, period}} or null, got {rec!r}")
        return cls(rec.get("usd"), rec.get("period", "month"))

    def to_record(self) -> dict[str, Any]:
        return {"usd": float(self.usd), "period": self.period}


@dataclass(frozen=True)
class Tenant:
    """Parsed tenant record (see the module docstring). Quota values are None for unlimited."""

    id: str
    keys: dict[str, dict[str, Any]] = field(default_factory=dict)
    quotas: dict[str, int | None] = field(default_factory=dict)
    priority: str = "interactive"
    weight: float = 1.0
    allowed_models: tuple[str, ...] = ()
    created: float = 0.0
    budget: Budget | None = None
    cache_group: str = ""  # prefix-cache sharing group ("" = the tenant's cache is its own; actors/cache_salt.py)

    @classmethod
    def from_record(cls, tenant_id: str, rec: Mapping[str, Any]) -> "Tenant":
        """Build from a stored record; missing fields take defaults. Raises TenantError if malformed."""
        if not isinstance(rec, Mapping):
            raise TenantError(f"tenant {tenant_id}: record is not an object")
        quotas = {k: rec.get("quotas", {}).get(k) for k in QUOTA_FIELDS}
        for k, v in quotas.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise TenantError(f"tenant {tenant_id}: quota {k} must be a non-negative integer or null")
        prio = rec.get("priority", "interactive")
        if prio not in PRIORITY_CLASSES:
            raise TenantError(f"tenant {tenant_id}: priority must be one of {', '.join(PRIORITY_CLASSES)}")
        try:
            budget = Budget.from_record(rec.get("budget"))
        except ValueError as exc:
            raise TenantError(f"tenant {tenant_id}: {exc}") from None
        group = rec.get("cache_group") or ""
        if not isinstance(group, str):
            raise TenantError(f"tenant {tenant_id}: cache_group must be a string")
        return cls(id=tenant_id, keys={k: dict(v) for k, v in (rec.get("keys") or {}).items()}, quotas=quotas, cache_group=group,
                   priority=prio, weight=float(rec.get("weight", 1.0)),
                   allowed_models=tuple(rec.get("allowed_models") or ()), created=float(rec.get("created", 0.0)),
                   budget=budget)

    def to_record(self) -> dict[str, Any]:
        """The JSON object stored in etcd."""
        return {"id": self.id, "created": self.created, "keys": self.keys, "quotas": dict(self.quotas),
                "priority": self.priority, "weight": self.weight, "allowed_models": list(self.allowed_models),
                "budget": self.budget.to_record() if self.budget is not None else None}

    def active_key_hashes(self) -> dict[str, str]:
        """``{hash: key_id}`` of the keys that are not revoked."""
        return {k["hash"]: kid for kid, k in self.keys.items() if k.get("hash") and not k.get("revoked")}

    def allows_model(self, model_name: str) -> bool:
        """True if ``model_name`` (a model name, all its versions) is on the allow-list ([] = none)."""
        return model_name in self.allowed_models

    def quota(self, name: str) -> int | None:
        """Quota ``name`` (one of QUOTA_FIELDS), None when unlimited."""
        return self.quotas.get(name)


class TenantAdmin:
    """Tenant management on a connected :class:`control.state.registry.Registry` (used by the CLI and ``up``)."""

    def __init__(self, registry) -> None:
        self.reg = registry

    async def get(self, tenant_id: str) -> Tenant:
        """The tenant; TenantError if unknown (ValueError for an invalid id)."""
        rec = await self.reg.get_tenant(tenant_id)
        if rec is None:
            raise TenantError(f"no tenant {tenant_id!r}")
        return Tenant.from_record(tenant_id, rec)

    async def list(self) -> list[Tenant]:
        """Every tenant, sorted by id (malformed records are skipped)."""
        out = []
        for tid, rec in sorted((await self.reg.list_tenants()).items()):
            try:
                out.append(Tenant.from_record(tid, rec))
            except TenantError:
                continue
        return out

    async def create(self, tenant_id: str, *, allowed_models: list[str] | tuple[str, ...] = (),
                     with_key: bool = True) -> tuple[Tenant, str | None, str | None]:
        """Create a tenant (no quotas, priority interactive, weight 1) and, by default, its first key.

        Returns ``(tenant, key_id, api_key)``; the key is shown only here. Raises TenantError if the
        tenant exists, ValueError for an invalid id or model name.
        """
        names.validate_name("tenant id", tenant_id)
        for m in allowed_models:
            names.validate_name("model name", m)
        rec: dict[str, Any] = {"id": tenant_id, "created": time.time(), "keys": {},
                               "quotas": {k: None for k in QUOTA_FIELDS}, "priority": "interactive",
                               "weight": 1.0, "allowed_models": sorted(set(allowed_models))}
        key_id = api_key = None
        if with_key:
            key_id, api_key = new_api_key()
            rec["keys"][key_id] = _key_entry(api_key)
        if not await self.reg.put_json_if_rev(names.tenant_key(tenant_id), rec, 0):
            raise TenantError(f"tenant {tenant_id!r} already exists")
        return Tenant.from_record(tenant_id, rec), key_id, api_key

    async def update(self, tenant_id: str, change: Callable[[dict[str, Any]], Any], attempts: int = 20) -> Tenant:
        """Apply ``change`` (mutates the record dict) with compare-and-swap, retrying on races.

        Raises TenantError if the tenant is unknown or the record kept changing under us."""
        key = names.tenant_key(tenant_id)
        for _ in range(attempts):
            rec, rev = await self.reg.get_json_rev(key)
            if rec is None:
                raise TenantError(f"no tenant {tenant_id!r}")
            change(rec)
            Tenant.from_record(tenant_id, rec)  # validate before writing
            if await self.reg.put_json_if_rev(key, rec, rev):
                return Tenant.from_record(tenant_id, rec)
        raise TenantError(f"tenant {tenant_id!r} changed concurrently {attempts} times; retry")

    async def add_key(self, tenant_id: str, api_key: str | None = None) -> tuple[str, str]:
        """Add an API key (fresh unless ``api_key`` is given); return ``(key_id, api_key)``."""
        key_id, fresh = new_api_key()
        api_key = api_key or fresh
        await self.update(tenant_id, lambda r: r.setdefault("keys", {}).__setitem__(key_id, _key_entry(api_key)))
        return key_id, api_key

    async def revoke_key(self, key_id: str) -> str:
        """Revoke key ``key_id`` (whichever tenant holds it); return the tenant id.

        Raises TenantError if no tenant has an active key with that id."""
        for t in await self.list():
            entry = t.keys.get(key_id)
            if entry is not None and not entry.get("revoked"):
                def change(r: dict[str, Any]) -> None:
                    e = r["keys"][key_id]
                    e.pop("hash", None)
                    e.pop("nats_hash", None)
                    e["revoked"] = time.time()
                await self.update(t.id, change)
                return t.id
        raise TenantError(f"no active key {key_id!r}")

    async def set_quota(self, tenant_id: str, **quotas: int | None) -> Tenant:
        """Set quotas (rpm, tpm, concurrency, daily_tokens); a value < 0 or None leaves it unchanged,
        0 for rpm/tpm/concurrency/daily_tokens refuses everything; use ``clear_quota`` to remove."""
        bad = set(quotas) - set(QUOTA_FIELDS)
        if bad:
            raise TenantError(f"unknown quota {', '.join(sorted(bad))}")

        def change(r: dict[str, Any]) -> None:
            q = r.setdefault("quotas", {})
            for k, v in quotas.items():
                if v is not None:
                    q[k] = None if v < 0 else int(v)
        return await self.update(tenant_id, change)

    async def allow_models(self, tenant_id: str, models: list[str]) -> Tenant:
        """Replace the allow-list with ``models`` (model names; [] = none)."""
        for m in models:
            names.validate_name("model name", m)
        return await self.update(tenant_id, lambda r: r.__setitem__("allowed_models", sorted(set(models))))

    async def set_priority(self, tenant_id: str, priority: str) -> Tenant:
        """Set the priority class (``interactive`` or ``batch``)."""
        if priority not in PRIORITY_CLASSES:
            raise TenantError(f"priority must be one of {', '.join(PRIORITY_CLASSES)}")
        return await self.update(tenant_id, lambda r: r.__setitem__("priority", priority))

    async def set_weight(self, tenant_id: str, weight: float) -> Tenant:
        """Set the fair-share weight (> 0)."""
        if not weight > 0:
            raise TenantError("weight must be > 0")
        return await self.update(tenant_id, lambda r: r.__setitem__("weight", float(weight)))

    async def set_cache_group(self, tenant_id: str, group: str | None) -> Tenant:
        """Put the tenant in prefix-cache sharing group ``group`` (None or "": its own cache again). Tenants of
        one group hit each other's cached prompt blocks (and can time each other's prompts); others never do.
        TenantError for a malformed name (1-64 characters of letters, digits, ``._-``)."""
        group = group or ""
        if group and not _GROUP_RE.fullmatch(group):
            raise TenantError("cache_group must be 1-64 characters of letters, digits, '.', '_' or '-'")

        def put(r: dict) -> None:
            if group:
                r["cache_group"] = group
            else:
                r.pop("cache_group", None)
        return await self.update(tenant_id, put)

    async def set_budget(self, tenant_id: str, usd: float | None, period: str = "month") -> Tenant:
        """Set the spend budget (``usd`` USD per ``period``: day, month or total); ``usd`` None clears it.
        TenantError naming the field for a bad value."""
        try:
            budget = None if usd is None else Budget(usd, period).to_record()
        except ValueError as exc:
            raise TenantError(str(exc)) from None
        return await self.update(tenant_id, lambda r: r.__setitem__("budget", budget))

    async def ensure_dev_tenant(self, state_dir: str | os.PathLike[str], models: list[str]) -> str:
        """Make sure tenant ``dev`` exists, allows ``models`` (added to its list) and accepts the key in
        ``<state_dir>/dev-api-key``; create that key (file mode 0600) on first use. Writes the key's NATS user
        name (its key id) to ``<state_dir>/dev-nats-user``. Returns the key."""
        path = Path(state_dir) / DEV_KEY_FILE
        key = path.read_text().strip() if path.exists() else ""
        try:
            await self.get(DEV_TENANT)
        except TenantError:
            await self.create(DEV_TENANT, allowed_models=models, with_key=False)
        if not key:
            key = new_api_key()[1]
            _write_private(path, key)
        h = hash_key(key)

        def change(r: dict[str, Any]) -> None:
            r["allowed_models"] = sorted(set(r.get("allowed_models") or ()) | set(models))
            kid = Tenant.from_record(DEV_TENANT, r).active_key_hashes().get(h)
            if kid is None:
                r.setdefault("keys", {})["kdev" + secrets.token_hex(4)] = _key_entry(key)
            elif not r["keys"][kid].get("nats_hash"):  # a state dir from before NATS users existed
                r["keys"][kid]["nats_hash"] = nats_password_hash(key)
        tenant = await self.update(DEV_TENANT, change)
        kid = tenant.active_key_hashes()[h]
        _write_private(Path(state_dir) / DEV_NATS_USER_FILE, kid)
        return key


def _key_entry(api_key: str) -> dict[str, Any]:
    return {"hash": hash_key(api_key), "nats_hash": nats_password_hash(api_key),
            "prefix": api_key[:len(KEY_PREFIX) + 4], "created": time.time(), "revoked": None}


def nats_password_hash(api_key: str) -> str:
    """bcrypt hash (cost NATS_BCRYPT_COST) of an API key: the password of the key's NATS user in the
    embedded nats-server's config (nats-server accepts bcrypt hashes as passwords; docs.nats.io,
    "Username/Password": bcrypted passwords). The user name is the key id."""
    import bcrypt
    return bcrypt.hashpw(api_key.encode("utf-8"), bcrypt.gensalt(NATS_BCRYPT_COST)).decode("ascii")


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def key_matches(api_key: str, stored_hash: str) -> bool:
    """Constant-time check of ``api_key`` against a stored ``sha256:`` hash."""
    return hmac.compare_digest(hash_key(api_key), stored_hash)
