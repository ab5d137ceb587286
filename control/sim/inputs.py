"""Reading the simulator's inputs file (control/sim/inputs/fleet.toml) into :class:`FleetInputs` (pure).

Every number in the file (a scalar or a list of numbers) must have a sibling ``<name>_source`` string saying
where it comes from (a price list, a paper, a datasheet, our measurement, or "design choice"); a number
without one is refused (ValueError naming the table and key). Curves: ``decode_batch`` /
``decode_tokens_per_s`` / ``decode_itl_ms`` and ``prefill_prompt_tokens`` / ``prefill_ttft_ms`` per type
become the live autoscaler's ``ThroughputCurve`` (control/policy/curves.py), so policies plan with the
same curve type the live autoscaler reads from ``actorserve profile``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Mapping

from control.policy.curves import DecodePoint, PrefillPoint, ThroughputCurve
from actors.autoscaler.signals import Slo
from control.sim.api import AccelType, CpuTier, FleetInputs, SpotModel, TraceSpec

DEFAULT_INPUTS = Path(__file__).resolve().parent / "inputs" / "fleet.toml"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_sources(table: Mapping[str, Any], where: str) -> list[str]:
    """Names of the numbers (scalars or lists of numbers) in ``table`` that lack a ``<name>_source`` string;
    nested tables and arrays of tables are walked with ``where`` extended."""
    missing = []
    for key, value in table.items():
        if isinstance(value, Mapping):
            missing += check_sources(value, f"{where}.{key}")
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            for i, item in enumerate(value):
                missing += check_sources(item, f"{where}.{key}[{i}]")
        elif _is_number(value) or (isinstance(value, list) and value and all(_is_number(v) for v in value)):
            src = table.get(f"{key}_source")
            if not isinstance(src, str) or not src.strip():
                missing.append(f"{where}.{key}")
    return missing


def _curve(t: Mapping[str, Any]) -> ThroughputCurve:
    n = t["name"]
    bs, tps, itl = t["decode_batch"], t["decode_tokens_per_s"], t["decode_itl_ms"]
    ps, ttft = t["prefill_prompt_tokens"], t["prefill_ttft_ms"]
    if not (len(bs) == len(tps) == len(itl)) or len(ps) != len(ttft):
        raise ValueError(f"types[{n}]: decode_* / prefill_* lists must have equal lengths")
    return ThroughputCurve(pool=n, measured_at=0.0, cpu="", decode=tuple(
        DecodePoint(int(b), float(x), float(y)) for b, x, y in zip(bs, tps, itl)),
        prefill=tuple(PrefillPoint(int(p), float(y)) for p, y in zip(ps, ttft)),
        meta={"source": t.get("decode_batch_source", "")})


def _type(t: Mapping[str, Any]) -> AccelType:
    sources = "; ".join(f"{k[:-7]}: {v}" for k, v in t.items() if k.endswith("_source"))
    return AccelType(t["name"], float(t["on_demand_per_h"]), float(t["spot_per_h"]), int(t["gpus_per_replica"]),
                     float(t["cold_start_s"]), _curve(t), sources, int(t["max_batch"]))


def _sources(d: Mapping[str, Any]) -> str:
    return "; ".join(f"{k[:-7]}: {v}" for k, v in d.items() if k.endswith("_source"))


def _plain(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not k.endswith("_source")}


def inputs_from_dict(data: Mapping[str, Any], path: str = "") -> FleetInputs:
    """FleetInputs from the parsed file (ValueError naming what is missing, unsourced or invalid)."""
    missing = check_sources(data, "inputs")
    if missing:
        raise ValueError(f"numbers without a <name>_source line: {', '.join(missing)}")
    try:
        types = {t["name"]: _type(t) for t in data["types"]}
        sp = data["spot"]
        spot = SpotModel({n: float(sp["preemption_rate_per_h"]) for n in types}, float(sp["notice_s"]),
                         float(sp["correlated_at_s"]), float(sp["correlated_fraction"]),
                         float(sp["correlated_over_s"]), _sources(sp))
        c = data["cpu_tier"]
        kinds = ("validator", "gateway")
        cpu = CpuTier({k: float(c[f"{k}_cpu_s_per_request"]) for k in kinds}, float(c["price_per_replica_h"]),
                      float(c["start_s"]), int(c.get("floor", 1)), int(c.get("ceiling", 10_000)), _sources(c),
                      {k: float(c[f"{k}_ttft_cpu_s_per_request"]) for k in kinds
                       if f"{k}_ttft_cpu_s_per_request" in c})
        trace = TraceSpec(**{k: v for k, v in _plain(data["trace"]).items()}, source=_sources(data["trace"]))
        f = data["fleet"]
        slo = Slo(float(data["slo"]["ttft_ms"]), float(data["slo"]["tpot_ms"]))
        return FleetInputs(types, spot, slo, cpu, trace, int(f["max_accelerators"]),
                           int(f["max_replicas_per_pool"]), float(f["spot_max_fraction"]),
                           float(f["decide_every_s"]), float(f["tick_s"]), path,
                           {"model": _sources(data.get("model", {})), "slo": _sources(data["slo"]),
                            "fleet": _sources(f)})
    except KeyError as e:
        raise ValueError(f"inputs: missing key {e}") from None
    except TypeError as e:
        raise ValueError(f"inputs: {e}") from None


def load_inputs(path: str | Path | None = None) -> FleetInputs:
    """Read ``path`` (default: the checked-in control/sim/inputs/fleet.toml)."""
    p = Path(path) if path else DEFAULT_INPUTS
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{p}: not valid TOML: {e}") from None
    return inputs_from_dict(data, str(p))
