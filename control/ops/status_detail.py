"""The per-worker detail line of ``actorserve status``: engine path, load phases, residency (bytes),
tensor-parallel ranks and LoRA adapters."""

from __future__ import annotations

from typing import Any


def worker_detail(info: Any) -> str:
    """``"float32+int4, loaded in 8.1 s (registry 0.9, ...), first token 0.4 s after"`` from a worker's
    etcd record (engine path, docs/engine.md; load phases, docs/model-loading.md); "" when it has neither."""
    from actors.worker.load_phases import describe

    if not isinstance(info, dict):
        return ""
    dtype, quant = info.get("dtype"), info.get("quantization")
    path = f"{dtype}{'+' + quant if quant else ''}" if dtype and info.get("engine") != "zero-compute" else ""
    if path and info.get("native_off"):  # the model's architecture runs the torch path (arch_spec.native_unsupported)
        path += f" (torch path: {info['native_off']})"
    if path and info.get("holds"):  # the projections as held (engine/kquant.py: exact, dense or re-quantized)
        path += f" (holds {info['holds']})"
    if path and info.get("row_kernels"):  # the measured kernel per step row count (engine/row_kernels.py)
        path += f" (kernels by rows: {info['row_kernels']})"
    if path and info.get("whole_step"):  # decode steps in one native call (engine/whole_step.py)
        path += f" (whole-step decode: {info['whole_step']})"
    return ", ".join(p for p in (_sleep(info), path, describe(info.get("load_phases") or {}, info.get("load_s")),
                                 _residency(info.get("memory")), _ranks(info), _adapters(info)) if p)


def _sleep(info: dict) -> str:
    """``"ASLEEP (KV 256.0 MiB freed; last wake 0.19 s)"`` for a sleeping worker (actors/worker/sleep.py), else
    ``"woke 3 times, last in 0.19 s"`` once it has woken; "" otherwise."""
    rec = info.get("sleep")
    if not isinstance(rec, dict):
        return ""
    if rec.get("state") == "sleeping":
        return (f"ASLEEP ({(rec.get('freed_bytes') or 0) / 2**20:.1f} MiB freed"
                + (f"; last wake {rec['wake_s']:.2f} s" if rec.get("wakes") else "") + ")")
    return f"woke {rec['wakes']} times, last in {rec.get('wake_s', 0):.2f} s" if rec.get("wakes") else ""


def _ranks(info: dict) -> str:
    """``"2 tensor-parallel ranks (0: weights 219.2 MiB + KV 42.7 MiB; 1: ...)"`` (docs/tensor-parallel.md); ""
    for a one-rank worker."""
    ranks = info.get("ranks")
    if not isinstance(ranks, list) or len(ranks) < 2:
        return ""
    mib = lambda n: f"{(n or 0) / 2**20:.1f} MiB"  # noqa: E731
    rows = [f"{r.get('rank')}: weights {mib(r.get('weights_bytes'))} + KV {mib(r.get('kv_bytes'))}"
            for r in ranks if isinstance(r, dict)]
    return f"{len(ranks)} tensor-parallel ranks ({'; '.join(rows)})"


def _adapters(info: dict) -> str:
    """``"LoRA adapters sql, chat"`` (docs/lora.md); "" without any."""
    names = info.get("adapters")
    return f"LoRA adapters {', '.join(map(str, names))}" if isinstance(names, list) and names else ""


def _residency(memory: Any) -> str:
    """``"resident m@1 int4 (weights 120.0 MiB + KV 256.0 MiB) of budget 376.0 MiB"`` from a worker record's
    ``memory`` (docs/model-loading.md); "" without one."""
    if not isinstance(memory, dict) or not isinstance(memory.get("resident"), list):
        return ""
    mib = lambda n: f"{(n or 0) / 2**20:.1f} MiB"  # noqa: E731
    rows = [f"{r.get('model')} {r.get('quantization')} (weights {mib(r.get('weights_bytes'))}"
            f"{' shared' if r.get('shared') else ''} + KV {mib(r.get('kv_bytes'))})"
            for r in memory["resident"] if isinstance(r, dict)]
    return f"resident {'; '.join(rows)} of budget {mib(memory.get('budget_bytes'))}" if rows else ""


def host_lines(hosts: list) -> list[str]:
    """Lines of the multi-version worker hosts (actors/worker/host.py, docs/model-loading.md): per host its
    budget, free bytes, loads and evictions, then one line per resident version (weights / KV, shared, state)."""
    mib = lambda n: f"{(n or 0) / 2**20:.1f} MiB"  # noqa: E731
    out: list[str] = []
    for h in sorted((h for h in hosts if isinstance(h, dict)), key=lambda h: str(h.get("host_id"))):
        out.append(f"{h.get('host_id')} (pid {h.get('pid')}): budget {mib(h.get('budget_bytes'))}, free "
                   f"{mib(h.get('free_bytes'))}, {h.get('loads', 0)} load(s), {h.get('evictions', 0)} eviction(s)"
                   + (f", asked for {', '.join(h['asked'])}" if h.get("asked") else ""))
        for r in h.get("resident") or []:
            if isinstance(r, dict):
                lora = f" + LoRA slots {mib(r['adapters_bytes'])}" if r.get("adapters_bytes") else ""
                out.append(f"  {r.get('model')} as {r.get('worker_id')}: weights {mib(r.get('weights_bytes'))}"
                           f"{' (shared)' if r.get('shared') else ''} + KV {mib(r.get('kv_bytes'))}{lora}, "
                           f"{r.get('quantization')}, {r.get('state')}")
    return out
