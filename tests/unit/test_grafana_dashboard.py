"""deploy/grafana/actorserve.json is an importable Grafana dashboard (JSON model) over our own metrics: a
Prometheus datasource variable used by every query, unique panel ids and refIds, panels on the 24-column grid
without overlaps, and every metric it names is an ``actorserve_*`` (or prometheus_client ``process_*``) metric
documented in docs/observability.md. tests/e2e/test_dashboard.py resolves the same names against a live stack."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana" / "actorserve.json"
METRIC = re.compile(r"\b((?:actorserve|process)_[a-z0-9_]+)")
SUFFIXES = ("_bucket", "_count", "_sum")


def dashboard() -> dict:
    return json.loads(GRAFANA.read_text())


def metric_names(dash: dict) -> set[str]:
    """Every metric name in the dashboard's PromQL (panel targets and template queries)."""
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    return {n for e in exprs for n in METRIC.findall(e)}


def base_name(sample: str) -> str:
    """A sample name's family name as docs/observability.md writes it (histograms without _bucket etc.)."""
    for s in SUFFIXES:
        if sample.endswith(s):
            return sample[: -len(s)]
    return sample


def test_datasource_variable_and_every_query_uses_it():
    dash = dashboard()
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


def test_panels_have_unique_ids_and_do_not_overlap_on_the_grid():
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine


def test_every_metric_named_is_ours_and_documented():
    names = metric_names(dashboard())
    assert len(names) >= 20
    doc = (ROOT / "docs" / "observability.md").read_text()
    for n in names:
        if n.startswith("process_"):
            continue
        family = base_name(n)
        assert f"`{family}`" in doc or f"`{family.removesuffix('_total')}" in doc, f"{n} not in observability.md"
    assert not any(n.startswith("vllm") for n in names)  # the dashboard is over our own names
