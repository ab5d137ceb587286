"""The report of ``actorserve bench serve`` (bench/serve_bench.py): the ``streams`` section of its JSON,
the issue-15 targets, the printed table and the PNG plot. Pure but for :func:`plot` (matplotlib, Agg)."""

from __future__ import annotations

from typing import Any

# Figures copied flat into streams.<n> as ours_<key> / peer_<key> (the rest stays under .ours / .peer).
FLAT = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_mean_ms", "completion_tokens",
        "ok", "requests")


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def level_entry(ours: dict[str, Any] | None, peer: dict[str, Any] | None, max_tokens: int) -> dict[str, Any]:
    """``streams.<n>`` of the JSON from both sides' :func:`bench.serve_client.level_stats` (either may be
    None: that side did not run): ``ours_<k>`` / ``peer_<k>`` for the FLAT figures, ``tok_s_ratio`` (ours /
    peer), ``ttft_p99_ratio`` and ``ttft_p50_ratio`` (ours / peer: below 1 is better), ``same_tokens``
    (both sides' ok requests each generated exactly ``max_tokens`` tokens, by usage), ``same_prompt_tokens``
    (both counted the same prompt tokens in total: the same chat template and tokenizer), and both raw dicts."""
    out: dict[str, Any] = {}
    for side, st in (("ours", ours), ("peer", peer)):
        for k in FLAT:
            out[f"{side}_{k}"] = None if st is None else st.get(k)
        out[side] = st
    out["tok_s_ratio"] = _ratio(out["ours_tok_s"], out["peer_tok_s"])
    out["ttft_p99_ratio"] = _ratio(out["ours_ttft_p99_ms"], out["peer_ttft_p99_ms"])
    out["ttft_p50_ratio"] = _ratio(out["ours_ttft_p50_ms"], out["peer_ttft_p50_ms"])
    out["same_tokens"] = (ours is not None and peer is not None and ours["token_check"] and peer["token_check"]
                          and ours["completion_tokens"] == peer["completion_tokens"])
    out["same_prompt_tokens"] = (ours is not None and peer is not None and ours["ok"] == peer["ok"]
                                 and ours.get("prompt_tokens") == peer.get("prompt_tokens"))
    out["max_tokens"] = max_tokens
    return out


def targets(streams: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 15's targets of the whole platform against the peer: tok/s ratio >= 1.2 at 1 stream, >= 3 at
    32, TTFT p99 at 32 streams <= the peer's. ``met`` is None where the level (or a side) did not run."""
    def at(n: str, key: str) -> float | None:
        return (streams.get(n) or {}).get(key)

    rows = [("tok/s ours/peer at 1 stream >= 1.2", at("1", "tok_s_ratio"), lambda v: v >= 1.2),
            ("tok/s ours/peer at 32 streams >= 3", at("32", "tok_s_ratio"), lambda v: v >= 3.0),
            ("TTFT p99 at 32 streams <= peer's (ratio <= 1)", at("32", "ttft_p99_ratio"), lambda v: v <= 1.0)]
    return [{"target": name, "measured": v, "met": None if v is None else bool(ok(v))} for name, v, ok in rows]


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return f"{v:,.{nd}f}" if isinstance(v, float) else str(v)


def table(report: dict[str, Any]) -> str:
    """The printed summary: one row per level (tok/s, TTFT p50/p99, ITL p50/p99 both sides, ratios, the
    token check), then the targets marked met / missed / not run."""
    head = ("streams", "ours tok/s", "peer tok/s", "ratio", "ours TTFT p50/p99 ms", "peer TTFT p50/p99 ms",
            "ours ITL p50/p99", "peer ITL p50/p99", "same tokens")
    rows = [head]
    for n, e in sorted(report["streams"].items(), key=lambda kv: int(kv[0])):
        rows.append((n, _f(e["ours_tok_s"]), _f(e["peer_tok_s"]), _f(e["tok_s_ratio"], 2),
                     f"{_f(e['ours_ttft_p50_ms'], 0)} / {_f(e['ours_ttft_p99_ms'], 0)}",
                     f"{_f(e['peer_ttft_p50_ms'], 0)} / {_f(e['peer_ttft_p99_ms'], 0)}",
                     f"{_f(e['ours_itl_p50_ms'])} / {_f(e['ours_itl_p99_ms'])}",
                     f"{_f(e['peer_itl_p50_ms'])} / {_f(e['peer_itl_p99_ms'])}", _f(e["same_tokens"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append("")
    for t in report["targets"]:
        mark = "not run" if t["met"] is None else ("met" if t["met"] else "MISSED")
        lines.append(f"  {t['target']}: {_f(t['measured'], 3)}  -> {mark}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """PNG at ``path``: aggregate streamed tok/s (left) and TTFT p50 / p99 in ms (right, log scale) against
    concurrent streams (log2 axis), ours and the peer. Raises OSError when the file cannot be written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(report["streams"], key=int)
    xs = [int(n) for n in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    peer = report.get("peer", {}).get("label", "peer")
    for side, label, style in (("ours", "actorserve (make run)", "-o"), ("peer", peer, "--s")):
        tok = [report["streams"][n][f"{side}_tok_s"] for n in levels]
        a.plot(xs, [float("nan") if v is None else v for v in tok], style, label=label)
        for q, alpha in (("p50", 1.0), ("p99", 0.5)):
            v = [report["streams"][n][f"{side}_ttft_{q}_ms"] for n in levels]
            b.plot(xs, [float("nan") if x is None else x for x in v], style, alpha=alpha, label=f"{label} {q}")
    for ax, title, ylabel in ((a, "aggregate streamed tokens/s", "tokens/s"), (b, "time to first token", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    b.set_yscale("log")
    cpu = report.get("cpu", {})
    fig.suptitle(f"bench serve: {cpu.get('model', '?')}, {cpu.get('cpus', '?')} CPUs, "
                 f"{report.get('max_tokens')} tokens/request", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
