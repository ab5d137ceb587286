"""The ``actorserve_*`` metrics again under vLLM's names and label conventions (``vllm:*``, ``model_name``).

Operators who already run Prometheus / Grafana for vLLM (its "Production Metrics" page,
docs.vllm.ai/en/stable/usage/metrics/, and docs/design/metrics.md of the vLLM repository: the V1 names) can
point their dashboards at a gateway, worker or scheduler ``/metrics`` unchanged. Each alias is computed **at
scrape time** from the series of the same scrape (:class:`VllmView`), so it carries exactly the same values as
its ``actorserve_*`` source and costs nothing per engine step or request: only a scrape does the renaming
(measured in tests/unit/test_vllm_metrics.py).

Label conventions: ``model`` (``name@version``) becomes ``model_name``; ``tenant`` is summed away (vLLM has no
tenant label; counters and histogram buckets add up exactly, so rates and quantiles are the deployment's);
every other label (``worker``, ``finished_reason``, ``le``) is kept. ``_total`` counters keep the suffix.

The alias table is :data:`VLLM_ALIASES` (source family -> vLLM family names); ours observe the inter-token
latency once per request (its mean interval, docs/observability.md), which is what vLLM's
``vllm:request_time_per_output_token_seconds`` means; ``vllm:inter_token_latency_seconds`` and the older
``vllm:time_per_output_token_seconds`` carry the same series for dashboards written against them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

#: ``actorserve_*`` family (prometheus_client's family name: no ``_total``) -> its vLLM family names
VLLM_ALIASES: Mapping[str, tuple[str, ...]] = {
    "actorserve_num_requests_running": ("vllm:num_requests_running",),
    "actorserve_num_requests_waiting": ("vllm:num_requests_waiting",),
    "actorserve_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc",),
    "actorserve_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "actorserve_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "actorserve_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "actorserve_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                               "vllm:time_per_output_token_seconds",
                                               "vllm:request_time_per_output_token_seconds"),
    "actorserve_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "actorserve_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "actorserve_request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "actorserve_request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "actorserve_prompt_tokens": ("vllm:prompt_tokens",),
    "actorserve_generation_tokens": ("vllm:generation_tokens",),
    "actorserve_request_success": ("vllm:request_success",),
    "actorserve_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "actorserve_request_generation_tokens": ("vllm:request_generation_tokens",),
}
MODEL_LABEL, VLLM_MODEL_LABEL, DROPPED_LABEL = "model", "model_name", "tenant"


def vllm_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """vLLM's labels for one of our sample's: ``model`` -> ``model_name``, ``tenant`` dropped, the rest kept."""
    out = {}
    for k, v in labels.items():
        if k == DROPPED_LABEL:
            continue
        out[VLLM_MODEL_LABEL if k == MODEL_LABEL else k] = v
    return out


def aliases_of(fam: Any) -> list[Any]:
    """The vLLM-named copies of one prometheus_client ``Metric`` family (empty when it has no alias).

    Each copy renames the family and its samples (``actorserve_x_bucket`` -> ``vllm:y_bucket``), maps the
    labels (:func:`vllm_labels`) and sums samples that became equal (the tenant label gone)."""
    from prometheus_client.metrics_core import Metric

    names = VLLM_ALIASES.get(fam.name)
    if not names:
        return []
    out = []
    for alias in names:
        copy = Metric(alias, fam.documentation or alias, fam.type, fam.unit if alias.endswith(f"_{fam.unit}") else "")
        sums: dict[tuple, float] = {}
        for s in fam.samples:
            key = (alias + s.name[len(fam.name):], tuple(vllm_labels(s.labels).items()))
            sums[key] = sums.get(key, 0.0) + s.value
        for (name, labels), value in sums.items():
            copy.add_sample(name, dict(labels), value)
        out.append(copy)
    return out


class VllmView:
    """A collector over ``registry`` (default: prometheus_client's) that yields every family, then the vLLM
    aliases of those that have one (:func:`aliases_of`), from one collection. Serve it in place of the
    registry (``generate_latest(VllmView())``, ``start_http_server(registry=VllmView())``)."""

    def __init__(self, registry: Any = None, names: Iterable[str] | None = None) -> None:
        if registry is None:
            from prometheus_client import REGISTRY
            registry = REGISTRY
        self.registry = registry
        self.names = frozenset(names) if names is not None else None

    def collect(self) -> Iterator[Any]:
        """Every family of the registry, then the vLLM aliases (restricted to :attr:`names` when set)."""
        fams = list(self.registry.collect())
        for fam in [*fams, *(a for f in fams for a in aliases_of(f))]:
            if self.names is None:
                yield fam
                continue
            kept = [s for s in fam.samples if s.name in self.names]
            if kept:
                fam.samples = kept
                yield fam

    def restricted_registry(self, names: Iterable[str]) -> "VllmView":
        """The view restricted to the sample names ``names`` (prometheus_client's ``?name[]=`` filter)."""
        return VllmView(self.registry, names)
