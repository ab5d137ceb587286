"""Per-tenant spend budgets: prices, a request's largest possible cost, and the spend record's rules (pure).

No I/O and no clock here: ``now`` (epoch seconds) is passed in. The KV shell is gateway/budget_store.py;
docs/budgets.md is the user and operator view and states the guarantee.

Units. Prices are USD per 1M tokens (manifest ``pricing``, control/state/manifest.py). Internally a price
is an integer number of pico-dollars per token (1 USD per 1M tokens = 1 micro-dollar per token =
10^6 pico-dollars per token), so token costs are exact integers. Budgets, spend and reservations are
integer micro-dollars; a request's cost is rounded up to the micro-dollar once, over the whole request.

The spend record of a tenant (key ``spend.<tenant>`` in KV bucket ``as_quota``)::

    {"p": "m202612",            # period the counters belong to (period_id)
     "s": 1234,                 # micro-USD charged in period p
     "u": 0,                    # micro-USD of cost that found no room (never charged; see settle)
     "m": {"tiny@1": 1234},     # micro-USD charged per model version in period p
     "r": {"<request id>": {"a": 5000,  # micro-USD reserved (the request's maximum cost)
                            "k": 0,     # pico-USD of cost settled so far
                            "c": [0],   # choice indexes not settled yet
                            "e": 1.7e9, # epoch s after which the reservation lapses
                            "pp": 150000, "cp": 600000,  # pico-USD per prompt / completion token
                            "v": "tiny@1"}}}

Invariant: ``s + reserved <= budget`` after every write made by these rules (``reserved`` = what the
reservations still hold, :func:`held`). A reservation is admitted only if it fits; a settlement moves at
most what its reservation holds from ``r`` to ``s``; a record without a reservation (lapsed, or a request
run without one) is charged at most the room left; lapsing only frees. So spend never exceeds the budget
in force when the requests were admitted (docs/budgets.md "Guarantee").
"""

from __future__ import annotations

import calendar
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

from control.policy.limits import MAX_CHOICES, default_max_tokens
from control.policy.numbers import is_int
from control.state.manifest import check_pricing
from gateway.openai_format import ApiError

PICO_PER_MICRO = 10**6
MICRO_PER_USD = 10**6
SETTLE_GRACE_S = 15.0  # a finished request's reservation waits this long for its completion records (s)
EXPIRY_MARGIN_S = 60.0  # a reservation lapses this long after its request's deadline (> METER ack wait, 30 s)
UNKNOWN_CONTEXT = 131_072  # tokens assumed when a manifest has no context_length (an upper bound)
SPECIAL_SLACK = 4  # tokens a tokenizer may add to a string prompt besides its bytes (BOS, EOS, prefix space)


def spend_key(tenant_id: str) -> str:
    """KV key of a tenant's spend record in bucket ``as_quota``."""
    return f"spend.{tenant_id}"


def ceil_micro(pico: int) -> int:
    """Pico-dollars rounded up to whole micro-dollars."""
    return -(-int(pico) // PICO_PER_MICRO)


def usd(micro: int) -> float:
    """Micro-dollars as USD."""
    return micro / MICRO_PER_USD


@dataclass(frozen=True)
class Pricing:
    """Integer pico-dollars per prompt token and per completion token."""

    prompt_pico: int
    completion_pico: int

    @classmethod
    def of(cls, manifest: Mapping[str, Any] | None) -> "Pricing | None":
        """The prices of a manifest dict; None when it has none or both are zero (free: nothing to charge).
        ValueError (naming ``pricing.<field>``) for a malformed one."""
        p = check_pricing((manifest or {}).get("pricing"))
        if p is None:
            return None
        out = cls(round(p["prompt_per_1m"] * 1e6), round(p["completion_per_1m"] * 1e6))
        return out if out.prompt_pico or out.completion_pico else None

    def cost_pico(self, prompt_tokens: int, completion_tokens: int) -> int:
        """Cost in pico-dollars of ``prompt_tokens`` and ``completion_tokens``."""
        return int(prompt_tokens) * self.prompt_pico + int(completion_tokens) * self.completion_pico


# -- the reservation bound --------------------------------------------------------------------------

def prompt_bounds(endpoint: str, body: Mapping[str, Any], ctx: int) -> list[tuple[int, int]]:
    """(least, most) prompt tokens of each prompt of a request, before tokenization.

    The validator refuses a prompt of ``ctx`` tokens or more, so ``ctx - 1`` bounds every prompt. A
    completions string prompt of b UTF-8 bytes has at most b + SPECIAL_SLACK tokens: every token of a
    byte-level BPE or byte-fallback SentencePiece vocabulary covers at least one byte (GGUF tokenizers,
    actors/text/tokenizer.py), plus the BOS/EOS and prefix-space tokens ``add_special_tokens`` may add. A
    token-id prompt is exact. A chat prompt is the rendered chat template, unknown here: ``(1, ctx - 1)``.
    """
    cap = max(1, ctx - 1)
    p = body.get("prompt")
    if endpoint not in ("completion", "completions"):
        return [(1, cap)]
    if isinstance(p, list) and p and all(is_int(x) for x in p):
        items: list[Any] = [p]
    elif isinstance(p, list) and p:
        items = list(p)
    else:
        items = [p]
    out = []
    for x in items:
        if isinstance(x, str):
            out.append((1, min(cap, len(x.encode("utf-8", "surrogatepass")) + SPECIAL_SLACK)))
        elif isinstance(x, list) and x:
            n = min(cap, len(x))
            out.append((n, n))
        else:
            out.append((1, cap))
    return out


def completion_limit(endpoint: str, body: Mapping[str, Any], manifest: Mapping[str, Any]) -> int | None:
    """The most tokens one choice may generate as the validator will settle it (actors/validator/prompts.py):
    the client's ``max_completion_tokens`` / ``max_tokens`` (the former first), else the manifest's or the
    server's default (16 on completions); None: only the context bounds it."""
    for field in ("max_completion_tokens", "max_tokens"):
        v = body.get(field)
        if v is not None:
            return v if is_int(v) and v >= 1 else None  # an invalid value is refused by the validator
    return default_max_tokens(endpoint, manifest.get("defaults") or {})


def max_cost_pico(bounds: list[tuple[int, int]], n: int, max_tokens: int | None, ctx: int, price: Pricing) -> int:
    """The largest cost (pico-USD) of a request: per prompt of P tokens in its (least, most) bound, the prompt
    once plus ``n`` choices of C <= min(max_tokens, ctx - P) tokens each (the validator's length rule; None
    max_tokens = ctx). The cost is linear in P on both sides of P = ctx - max_tokens, so its maximum lies at a
    bound or there. Summing over prompts bounds the meter's charge (it counts one prompt per request)."""
    m = ctx if max_tokens is None else max_tokens
    total = 0
    for lo, hi in bounds:
        def cost(p: int) -> int:
            return price.cost_pico(p, n * max(1, min(m, ctx - p)))
        total += max(cost(p) for p in {lo, hi, min(hi, max(lo, ctx - m))})
    return total


def request_max_cost_micro(endpoint: str, body: Mapping[str, Any], manifest: Mapping[str, Any],
                           price: Pricing) -> int:
    """The reservation of one request (micro-USD, rounded up): :func:`max_cost_pico` with the manifest's
    ``context_length`` (UNKNOWN_CONTEXT when missing), ``n`` choices (capped like the gateway's choice count)
    and :func:`completion_limit`."""
    ctx = manifest.get("context_length")
    ctx = ctx if is_int(ctx) and ctx >= 2 else UNKNOWN_CONTEXT
    n = body.get("n")
    n = min(n, MAX_CHOICES + 1) if is_int(n) and n >= 1 else 1
    return ceil_micro(max_cost_pico(prompt_bounds(endpoint, body, ctx), n, completion_limit(endpoint, body, manifest),
                                    ctx, price))


# -- periods ----------------------------------------------------------------------------------------

def period_id(period: str, now: float) -> str:
    """The id of the budget period holding epoch second ``now``: ``dYYYYMMDD`` (UTC day), ``mYYYYMM``
    (UTC month) or ``total``."""
    t = time.gmtime(now)
    if period == "day":
        return time.strftime("d%Y%m%d", t)
    if period == "month":
        return time.strftime("m%Y%m", t)
    if period == "total":
        return "total"
    raise ValueError(f"budget period must be day, month or total, got {period!r}")


def period_reset(period: str, now: float) -> float | None:
    """Epoch second at which the period holding ``now`` ends (None for ``total``: never)."""
    t = time.gmtime(now)
    if period == "day":
        return calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0)) + 86400.0
    if period == "month":
        y, m = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
        return float(calendar.timegm((y, m, 1, 0, 0, 0)))
    return None


# -- the spend record -------------------------------------------------------------------------------

def held(res: Mapping[str, Any]) -> int:
    """Micro-USD one reservation still holds: its amount less what was settled against it."""
    a = int(res.get("a", 0))
    return a - min(a, ceil_micro(res.get("k", 0)))


def current(value: Mapping[str, Any] | None, pid: str, now: float) -> dict:
    """The spend record for period ``pid`` at ``now``: counters reset when the period moved on, lapsed
    reservations (``e <= now``) dropped. Returns a new dict."""
    v = dict(value or {})
    if v.get("p") != pid:
        v.update(p=pid, s=0, u=0, m={})
    v.setdefault("s", 0)
    v.setdefault("u", 0)
    v["m"] = dict(v.get("m") or {})
    v["r"] = {rid: res for rid, res in (v.get("r") or {}).items() if float(res.get("e", 0)) > now}
    return v


def reserved(v: Mapping[str, Any]) -> int:
    """Micro-USD the record's reservations hold together."""
    return sum(held(res) for res in (v.get("r") or {}).values())


def reserve(value: Mapping[str, Any] | None, *, request_id: str, amount: int, budget: int, pid: str, now: float,
            expires_at: float, choices: int, price: Pricing, model: str) -> dict | None:
    """The record with a reservation of ``amount`` micro-USD for ``request_id`` (``choices`` choice
    records expected; lapses at ``expires_at``), or None (refused) when spent + reserved + amount would
    exceed ``budget``. A reservation already held under this id is replaced (a request run again)."""
    v = current(value, pid, now)
    v["r"].pop(request_id, None)
    if v["s"] + reserved(v) + amount > budget:
        return None
    v["r"][request_id] = {"a": int(amount), "k": 0, "c": list(range(max(1, choices))), "e": float(expires_at),
                          "pp": price.prompt_pico, "cp": price.completion_pico, "v": model}
    return v


def _reservation_of(r: Mapping[str, Any], record_id: str) -> str | None:
    """The reservation key of a completion record's id: the id itself, or ``<id>`` of a fanned-out choice
    ``<id>-<index>`` (actors/validator/service.py names choices so)."""
    if record_id in r:
        return record_id
    parent, sep, index = record_id.rpartition("-")
    return parent if sep and index.isdigit() and parent in r else None


def settle(value: Mapping[str, Any] | None, *, record_id: str, choice: int, prompt_tokens: int,
           completion_tokens: int, price: Pricing | None, budget: int, pid: str, now: float,
           model: str) -> tuple[dict | None, int]:
    """(new record or None for no write, cost in pico-USD) after one completion record.

    With a pending reservation: the cost at the reservation's prices is charged, but never more than the
    reservation (what the bound missed, e.g. a price raised in flight, goes to ``u``); the choice is done,
    and once every choice is, the reservation goes (its unspent rest is free again). A record whose choice
    was settled already (a redelivered record) changes nothing. Without a reservation (it lapsed, or the
    request ran without one): the cost at ``price`` is charged up to the room left (budget - spent -
    reserved), the rest goes to ``u``."""
    v = current(value, pid, now)
    key = _reservation_of(v["r"], record_id)
    res = v["r"].get(key) if key is not None else None
    if res is not None:
        cost = prompt_tokens * int(res["pp"]) + completion_tokens * int(res["cp"])
        if choice not in res["c"]:
            return None, cost
        k0, k1, a = int(res["k"]), int(res["k"]) + cost, int(res["a"])
        charge = min(a, ceil_micro(k1)) - min(a, ceil_micro(k0))
        lost = ceil_micro(k1) - ceil_micro(k0) - charge
        left = [c for c in res["c"] if c != choice]
        if left:
            v["r"][key] = {**res, "k": k1, "c": left}
        else:
            del v["r"][key]
    else:
        cost = price.cost_pico(prompt_tokens, completion_tokens) if price is not None else 0
        if cost == 0:
            return None, 0
        want = ceil_micro(cost)
        charge = min(want, max(0, budget - v["s"] - reserved(v)))
        lost = want - charge
    v["s"] += charge
    v["u"] += lost
    v["m"][model] = int(v["m"].get(model, 0)) + charge
    return v, cost


def end(value: Mapping[str, Any] | None, request_id: str, now: float) -> dict | None:
    """The record with ``request_id``'s reservation set to lapse within SETTLE_GRACE_S (its request ended
    on the gateway; its completion records are on their way), or None (no write) when it holds none."""
    res = (value or {}).get("r", {}).get(request_id)
    if res is None or float(res.get("e", 0)) <= now + SETTLE_GRACE_S:
        return None
    return {**value, "r": {**value["r"], request_id: {**res, "e": now + SETTLE_GRACE_S}}}


def drop(value: Mapping[str, Any] | None, request_id: str) -> dict | None:
    """The record without ``request_id``'s reservation (its request was never submitted), or None."""
    r = (value or {}).get("r", {})
    if request_id not in r:
        return None
    return {**value, "r": {k: x for k, x in r.items() if k != request_id}}


def view(value: Mapping[str, Any] | None, budget: int, period: str, now: float) -> dict:
    """The cost report of a spend record (USD): budget, period, spent, reserved, remaining, ..."""
    v = current(value, period_id(period, now), now)
    spent, held_now = int(v["s"]), reserved(v)
    return {"budget_usd": usd(budget), "period": period, "period_id": v["p"], "resets_at": period_reset(period, now),
            "spent_usd": usd(spent), "reserved_usd": usd(held_now),
            "remaining_usd": usd(max(0, budget - spent - held_now)), "unbilled_usd": usd(int(v["u"])),
            "in_flight": len(v["r"]), "by_model_usd": {m: usd(int(x)) for m, x in sorted(v["m"].items())}}


# -- errors -----------------------------------------------------------------------------------------

def exhausted(tenant_id: str, period: str, budget: int, value: Mapping[str, Any] | None, amount: int,
              model: str, now: float) -> ApiError:
    """The 429 ``budget_exhausted`` of a reservation that does not fit (OpenAI error shape, type
    ``insufficient_quota``). Retry-After: 1 s when returning reservations would make room, else the time to
    the period's reset (none for ``total`` or a request larger than the whole budget)."""
    v = current(value, period_id(period, now), now)
    spent, held_now = int(v["s"]), reserved(v)
    left = max(0, budget - spent - held_now)
    reset = period_reset(period, now)
    if amount > budget:
        retry = None
        hint = "it is larger than the whole budget: lower max_tokens (or the prompt), or ask for a larger budget"
    elif spent + amount <= budget:
        retry, hint = 1.0, "requests in flight hold the rest; retry when they finish"
    elif reset is not None:
        retry = max(1.0, math.ceil(reset - now))
        hint = f"the budget resets at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(reset))}"
    else:
        retry, hint = None, "the budget has no period reset; ask the operator to raise it"
    return ApiError(429, f"Budget exhausted for tenant {tenant_id}: the {period} budget is ${usd(budget):.6f}; "
                    f"${usd(spent):.6f} spent and ${usd(held_now):.6f} reserved by requests in flight leave "
                    f"${usd(left):.6f}, and this request may cost up to ${usd(amount):.6f} (prompt + max_tokens at "
                    f"{model}'s prices): {hint}.", type="insufficient_quota", code="budget_exhausted",
                    retry_after=retry, headers={"x-actorserve-budget-remaining-usd": f"{usd(left):.6f}"})


def unavailable(tenant_id: str) -> ApiError:
    """The 503 ``budget_unavailable`` when the spend record cannot be read or written: a budget fails
    closed (money), unlike a rate quota (fairness), which fails open."""
    return ApiError(503, f"the spend budget of tenant {tenant_id} cannot be checked right now; retry",
                    type="unavailable", code="budget_unavailable", retry_after=1.0)
