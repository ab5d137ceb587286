"""PNG plots of simulated policies (matplotlib, Agg backend: no display needed).

One figure per quantity, every policy in it, x axis in simulated hours, from ``PolicyResult.per_minute``
(``t_min``, ``load_rps``, ``attainment``, ``cost_usd_cum``, ``replicas``: pool key -> list):

* ``load.png`` — offered load (req/s, per-minute mean; the same trace for every policy, so the lines overlap);
* ``replicas.png`` — replicas per pool, one panel per policy, stacked by pool key (``<type>/<market>``; spot
  pools hatched);
* ``attainment.png`` — per-minute fraction of requests within the SLO (TTFT and mean TPOT), y from the
  lowest value seen (at most 0.9) to 1;
* ``cost.png`` — cumulative cost (USD).

Long runs are drawn at most ``max_points`` points per line (per-minute values reduced by the minimum for
attainment, the mean for load, the last for cumulative cost and replicas by the maximum), so a 7-day run
(10,080 minutes) plots in about a second.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

FIGURES = ("load", "replicas", "attainment", "cost")
MAX_POINTS = 2000


def _reduce(xs: Sequence[float], ys: Sequence[float], how: Callable[[Sequence[float]], float],
            max_points: int) -> tuple[list[float], list[float]]:
    """(x, y) with at most ``max_points`` points: consecutive groups of equal size, x their first, y ``how``
    of the group's values."""
    n = len(xs)
    step = max(1, math.ceil(n / max_points))
    return ([xs[i] for i in range(0, n, step)], [_safe(how, ys[i:i + step]) for i in range(0, n, step)])


def _safe(how: Callable[[Sequence[float]], float], values: Sequence[Any]) -> float:
    """``how`` of the finite values (a minute with no request has None or NaN attainment); NaN if none."""
    ok = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return how(ok) if ok else math.nan


def _hours(pm: dict) -> list[float]:
    return [t / 60.0 for t in pm["t_min"]]


def _mean(v: Sequence[float]) -> float:
    return sum(v) / len(v)


def _line_figure(plt: Any, results: Sequence[Any], series: str, how: Callable, ylabel: str, title: str,
                 max_points: int) -> Any:
    fig, ax = plt.subplots(figsize=(12, 4))
    for r in results:
        pm = r.per_minute
        x, y = _reduce(_hours(pm), pm[series], how, max_points)
        ax.plot(x, y, label=r.name, linewidth=0.9)
    ax.set_xlabel("simulated time (h)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return fig, ax


def _replicas_figure(plt: Any, results: Sequence[Any], max_points: int) -> Any:
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 2.6 * len(results)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        pm = r.per_minute
        keys = [k for k in sorted(pm["replicas"]) if any(pm["replicas"][k])]
        if keys:
            x = _reduce(_hours(pm), pm["t_min"], max, max_points)[0]
            ys = [_reduce(_hours(pm), pm["replicas"][k], max, max_points)[1] for k in keys]
            polys = ax.stackplot(x, *ys, labels=keys, alpha=0.85)
            for key, poly in zip(keys, polys):
                if key.endswith("/spot"):
                    poly.set_hatch("//")
            ax.legend(loc="upper left", fontsize=7, ncol=min(3, len(keys)))
        ax.set_ylabel("replicas")
        ax.set_title(r.name, fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("simulated time (h)")
    fig.tight_layout()
    return fig


def write_plots(results: Sequence[Any], out_dir: str | Path, max_points: int = MAX_POINTS) -> list[str]:
    """Write the four PNGs (module docstring) of ``results`` (PolicyResult, each with ``per_minute``) into
    ``out_dir`` (made if missing); the paths written, in FIGURES order. ValueError when there is nothing to
    plot or a result lacks its per-minute series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = list(results)
    if not results:
        raise ValueError("write_plots: no results to plot")
    for r in results:
        missing = [k for k in ("t_min", "load_rps", "attainment", "cost_usd_cum", "replicas")
                   if k not in (r.per_minute or {})]
        if missing:
            raise ValueError(f"write_plots: result {r.name!r} lacks per_minute {', '.join(missing)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    figs = {
        "load": _line_figure(plt, results, "load_rps", _mean, "req/s", "offered load (per-minute mean)",
                             max_points)[0],
        "replicas": _replicas_figure(plt, results, max_points),
        "attainment": _attainment(plt, results, max_points),
        "cost": _line_figure(plt, results, "cost_usd_cum", lambda v: v[-1], "USD", "cumulative cost",
                             max_points)[0],
    }
    for name in FIGURES:
        path = out / f"{name}.png"
        figs[name].savefig(path, dpi=100)
        plt.close(figs[name])
        paths.append(str(path))
    return paths


def _attainment(plt: Any, results: Sequence[Any], max_points: int) -> Any:
    fig, ax = _line_figure(plt, results, "attainment", min, "fraction within SLO",
                           "SLO attainment per minute (lowest minute of each point)", max_points)
    lows = [_safe(min, r.per_minute["attainment"]) for r in results]
    lows = [v for v in lows if not math.isnan(v)]
    ax.set_ylim(max(0.0, min([0.9] + lows) - 0.01), 1.005)
    ax.axhline(0.995, color="grey", linestyle="--", linewidth=0.7)
    return fig
