"""Kubernetes scaling by KEDA (issue [27] item 3): ``actorserve deploy k8s`` (control/ops/k8s_render.py) renders a
Deployment per model version and pool and a KEDA ScaledObject for each of them and for the validators.

* The ScaledObjects validate against KEDA's CRD schema (deploy/k8s/vendor/keda/, its header says what it is),
  strictly (unknown fields refused, as ``kubectl apply --validate=strict`` does), plus the CRD's CEL rule; the
  Deployments and PDBs against the Kubernetes schemas (kubernetes-validate), like the base.
* HPA's formula for an AverageValue target of 1 gives back desired counts 0, 1, 3 and 7 from any current count,
  within the autoscaler's floor and ceiling (KEDA's activation for 0).
* Each trigger's query selects exactly the series the autoscaler's leader exports for that target
  (actors/autoscaler/export.py), the floors and ceilings are the autoscaler's, a worker's grace period covers
  its drain, and the committed outputs for the default model are not stale.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from actors.autoscaler import export  # noqa: E402
from actors.autoscaler.service import AutoscalerConfig  # noqa: E402
from control.ops import k8s_render as r  # noqa: E402
from control.ops.cli import build_parser, main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "deploy" / "k8s" / "vendor" / "keda" / "keda.sh_scaledobjects.yaml"
VERSIONS = ("1.30.0", "1.37.0")

MULTI = r.RenderConfig(workers=(r.parse_worker("smollm2-135m-instruct@1"), r.parse_worker("big_model@2/spot=0:12"),
                                r.parse_worker("big_model@2/local=1:3")), validators=(1, 4))


def strict(schema: dict) -> dict:
    """The CRD's OpenAPI schema as JSON Schema that refuses unknown fields (what strict field validation does;
    the API server would prune them silently otherwise)."""
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(s)
    s["properties"]["metadata"] = {"type": "object", "required": ["name"],
                                   "properties": {"name": {"type": "string"}, "labels": {"type": "object"}}}
    return s


@pytest.fixture(scope="module")
def crd() -> dict:
    return yaml.safe_load(CRD.read_text())


@pytest.fixture(scope="module")
def so_schema(crd) -> dict:
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return strict(version["schema"]["openAPIV3Schema"])


def check_scaled_object(so: dict, schema: dict) -> None:
    jsonschema.Draft7Validator(schema).validate(so)
    spec = so["spec"]
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["kind"] == "ScaledObject"
    assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100), "the CRD's CEL rule"
    (trig,) = spec["triggers"]
    assert trig["type"] == "prometheus" and trig["metricType"] == "AverageValue"  # KEDA's webhook: one of 3
    meta = trig["metadata"]
    assert meta["threshold"] == "1" and meta["query"].startswith(f"max({export.METRIC}{{")
    assert meta["ignoreNullValues"] == "false", "no series (no leader): keep the count, not scale to the floor"
    assert re.fullmatch(r"https?://\S+", meta["serverAddress"])


def test_the_vendored_crd_says_what_it_is(crd):
    head = CRD.read_text().split("apiVersion:", 1)[0]
    assert "RECONSTRUCTION" in head and "keda-version: 2.20.2" in head and "https://github.com/" in head
    assert crd["metadata"]["name"] == "scaledobjects.keda.sh" and crd["spec"]["group"] == "keda.sh"


@pytest.mark.parametrize("cfg", [r.RenderConfig(), MULTI], ids=["default", "multi"])
def test_scaled_objects_validate_against_kedas_crd(cfg, so_schema):
    sos = r.keda_docs(cfg)
    assert len(sos) == 1 + len(cfg.workers)
    for so in sos:
        check_scaled_object(so, so_schema)
    bad = copy.deepcopy(sos[0])
    bad["spec"]["triggers"][0]["metadata"]["threshold"] = 1  # metadata values are strings
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(so_schema).validate(bad)
    bad = copy.deepcopy(sos[0])
    bad["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilisation"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(so_schema).validate(bad)


@pytest.mark.parametrize("version", VERSIONS)
def test_rendered_deployments_validate_against_kubernetes(version):
    errors = []
    for d in r.model_docs(MULTI):
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{d['kind']}/{d['metadata']['name']}: {e.message} at {list(e.path)}")
    assert not errors, "\n".join(errors)


def test_each_version_and_pool_gets_a_deployment_and_a_scaled_object():
    docs = r.model_docs(MULTI)
    deps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    pdbs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert set(deps) == set(pdbs) == {
        "actorserve-scheduler-smollm2-135m-instruct-1", "actorserve-worker-smollm2-135m-instruct-1-local",
        "actorserve-scheduler-big-model-2", "actorserve-worker-big-model-2-spot", "actorserve-worker-big-model-2-local"}
    for name, d in deps.items():
        pod = d["spec"]["template"]
        args = pod["spec"]["containers"][0]["args"]
        parsed = build_parser().parse_args(args)  # the actor's own CLI accepts them
        labels = pod["metadata"]["labels"]
        assert parsed.model == f"{labels['actorserve.io/model']}@{labels['actorserve.io/model-version']}"
        if labels["app.kubernetes.io/component"] == "worker":
            assert "replicas" not in d["spec"], "the ScaledObject owns a worker Deployment's count"
            assert parsed.pool == labels["actorserve.io/pool"]
        else:
            assert d["spec"]["replicas"] == 2, "scheduler: active and standby"
        sel = d["spec"]["selector"]["matchLabels"]
        others = [o for o, od in deps.items() if o != name
                  and all(od["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())]
        assert not others, f"{name}'s selector also matches {others}"
    sos = {s["metadata"]["name"]: s for s in r.keda_docs(MULTI)}
    for name, so in sos.items():
        assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert name == "actorserve-validator" or name in deps
    assert (sos["actorserve-worker-big-model-2-spot"]["spec"]["minReplicaCount"],
            sos["actorserve-worker-big-model-2-spot"]["spec"]["maxReplicaCount"]) == (0, 12)
    assert (sos["actorserve-validator"]["spec"]["minReplicaCount"],
            sos["actorserve-validator"]["spec"]["maxReplicaCount"]) == (1, 4)


# -- HPA's formula -------------------------------------------------------------------------------


def settle(value: int, current: int, floor: int, ceiling: int, rounds: int = 3, **kw) -> int:
    for _ in range(rounds):
        current = r.hpa_replicas(value, current, floor, ceiling, **kw)
    return current


@pytest.mark.parametrize("desired", [0, 1, 3, 7])
def test_hpas_formula_gives_back_the_desired_count(desired):
    """AverageValue, threshold 1: HPA asks for ceil(value / 1) = the desired count from any current count (one
    round when current > 0; KEDA's activation takes 0 -> 1 first, and 1 -> 0 when the value is 0)."""
    floor, ceiling = 0, 8  # a scale-to-zero version: 0 is allowed
    for current in range(0, ceiling + 1):
        one = r.hpa_replicas(desired, current, floor, ceiling)
        if current > 0 and desired > 0:
            assert one == desired, (current, desired)
        assert settle(desired, current, floor, ceiling) == desired, (current, desired)
    # with the autoscaler's floor 1 (no scale to zero) a 0 can not come from it; were it written, the floor holds
    assert settle(desired, 2, 1, 8) == max(desired, 1)
    assert settle(desired, 2, 1, 2) == min(max(desired, 1), 2), "the ceiling holds"


def test_hpas_tolerance_and_why_large_ceilings_render_tolerance_zero():
    assert r.hpa_replicas(9, 10, 1, 20) == 10, "HPA's default 10 % tolerance ignores 10 -> 9"
    assert r.hpa_replicas(12, 11, 1, 20) == 11, "and 11 -> 12"
    assert r.hpa_replicas(9, 10, 1, 20, tolerance=0.0) == 9 and r.hpa_replicas(12, 11, 1, 20, tolerance=0.0) == 12
    for current in range(1, 10):  # below 10 replicas no change of one is within 10 %
        assert r.hpa_replicas(current + 1, current, 1, 10) == current + 1
        assert r.hpa_replicas(current - 1, current, 1, 10) == max(1, current - 1)
    assert r.hpa_replicas(9, 10, 1, 10) == 10
    big = {s["spec"]["maxReplicaCount"]: s["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
           for s in r.keda_docs(MULTI)}
    assert big[12]["scaleUp"]["tolerance"] == big[12]["scaleDown"]["tolerance"] == "0"
    assert "tolerance" not in big[3]["scaleUp"]


# -- the trigger follows the leader's series -----------------------------------------------------


def _matches(promql: str, labels: dict) -> bool:
    m = re.fullmatch(r"max\((\w+)\{(.*)\}\)", promql)
    assert m and m.group(1) == export.METRIC
    pairs = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
    return all(labels.get(k, "") == v for k, v in pairs.items())


def test_each_query_selects_its_targets_series_on_the_leader_only():
    from actors.autoscaler.collect import Desired

    desired = {"validator": Desired(3, 0.0), "gateway": Desired(1, 0.0)}
    desired.update({f"{w.name}/{w.version}/{w.pool}": Desired(i + 2, 0.0) for i, w in enumerate(MULTI.workers)})
    leader = SimpleNamespace(is_leader=True, state=SimpleNamespace(desired=desired), snapshot={})
    standby = SimpleNamespace(is_leader=False, state=SimpleNamespace(desired=desired), snapshot={})
    series = export.desired_samples(leader)
    assert export.desired_samples(standby) == []
    for so in r.keda_docs(MULTI):
        q = so["spec"]["triggers"][0]["metadata"]["query"]
        hits = [v for v, labels in series if _matches(q, labels)]
        target = so["spec"]["scaleTargetRef"]["name"]
        if target == "actorserve-validator":
            assert hits == [3.0]
        else:
            (w,) = [w for w in MULTI.workers if r.worker_name(w) == target]
            assert hits == [float(desired[f"{w.name}/{w.version}/{w.pool}"].count)], target


def test_floors_and_ceilings_default_to_the_autoscalers():
    cfg = AutoscalerConfig()
    assert r.DEFAULT_WORKER_LIMITS == (cfg.worker_limits.floor, cfg.worker_limits.ceiling)
    assert r.DEFAULT_VALIDATOR_LIMITS == (cfg.cpu_limits["validator"].floor, cfg.cpu_limits["validator"].ceiling)
    assert r.DEFAULT_POOL == cfg.pool
    base = ROOT / "deploy" / "k8s" / "base" / "actors" / "autoscaler.yaml"
    (dep,) = [d for d in yaml.safe_load_all(base.read_text()) if d and d["kind"] == "Deployment"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(c["args"])
    assert "--limits" not in c["args"] and "--worker-limits" not in c["args"] and "--pool" not in c["args"]
    assert args.metrics_host == "0.0.0.0" and args.metrics_port == 9100
    assert {"name": "metrics", "containerPort": 9100} in c["ports"]
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9100"


def test_a_worker_drains_before_it_is_killed_and_one_at_a_time():
    from actors.worker.actor import add_arguments as worker_arguments
    import argparse

    p = argparse.ArgumentParser()
    worker_arguments(p)
    default_drain = p.parse_args([]).drain_timeout
    assert r.DEFAULT_DRAIN_TIMEOUT_S == default_drain
    for cfg in (r.RenderConfig(), r.RenderConfig(drain_timeout_s=45)):
        for d in r.model_docs(cfg):
            if d["kind"] != "Deployment" or "worker" not in d["metadata"]["name"]:
                continue
            spec = d["spec"]["template"]["spec"]
            args = spec["containers"][0]["args"]
            drain = float(args[args.index("--drain-timeout") + 1])
            # SIGTERM: credits (1 s) + lease revoke (3 s) + drain, inside the stop's drain + 5 s; then the bus
            assert drain == cfg.drain_timeout_s and spec["terminationGracePeriodSeconds"] >= drain + 5 + 4 + 5
        for so in r.keda_docs(cfg)[1:]:
            down = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
            assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": cfg.grace_s}]


# -- the committed outputs and the CLI -----------------------------------------------------------


def test_the_committed_default_outputs_are_not_stale():
    for path, text in r.default_files().items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run python -m control.ops.k8s_render"
    kust = yaml.safe_load((ROOT / "deploy" / "k8s" / "keda" / "kustomization.yaml").read_text())
    assert kust["resources"] == ["../base", "keda.yaml"]


def test_yaml_writer_round_trips():
    for cfg in (r.RenderConfig(), MULTI):
        docs = r.model_docs(cfg) + r.keda_docs(cfg)
        text = r.yaml_stream(docs)
        assert [d for d in yaml.safe_load_all(text) if d] == docs
    odd = {"a": ["yes", "1", "", "x: y", "-v", {}, [], None, True], "b": {"c": "N"}}
    assert yaml.safe_load(r.to_yaml(odd)) == odd


def test_cli_writes_a_directory_and_refuses_bad_targets(tmp_path, capsys):
    with pytest.raises(SystemExit) as ei:
        main(["deploy", "k8s", "--worker", "big_model@2/spot=0:12", "--worker", "big_model@2", "--validators", "1:4",
              "--prometheus", "http://prom:9090", "--out", str(tmp_path)])
    assert ei.value.code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keda.yaml", "kustomization.yaml", "models.yaml"]
    sos = [d for d in yaml.safe_load_all((tmp_path / "keda.yaml").read_text()) if d]
    assert [s["spec"]["triggers"][0]["metadata"]["serverAddress"] for s in sos] == ["http://prom:9090"] * 3
    for bad in (["--worker", "nomodel"], ["--worker", "m@1=3:2"], ["--worker", "m@1", "--worker", "m@1/local"],
                ["--validators", "x"], ["--prometheus", "prom:9090"]):
        with pytest.raises(SystemExit) as ei:
            main(["deploy", "k8s", *bad])
        assert ei.value.code == 2, bad
        assert "actorserve deploy k8s:" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["m" * 128, "a_b-"])
def test_long_or_odd_names_become_valid_kubernetes_names(name):
    w = r.WorkerTarget(name, "1")
    for n in (r.worker_name(w), r.scheduler_name(w)):
        assert len(n) <= 63 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", n), n
    v = r.label_value(name)
    assert len(v) <= 63 and re.fullmatch(r"[a-z0-9]([a-z0-9_.-]*[a-z0-9])?", v)
    assert r.worker_name(r.WorkerTarget(name, "2")) != r.worker_name(w)


def test_the_keda_overlay_renders_the_base_and_its_scaled_objects():
    import shutil
    import subprocess

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy" / "k8s" / "keda")], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    sos = [d for d in rendered if d["kind"] == "ScaledObject"]
    key = lambda d: d["metadata"]["name"]  # noqa: E731
    assert sorted(sos, key=key) == sorted(r.keda_docs(r.RenderConfig()), key=key)
    deps = {d["metadata"]["name"] for d in rendered if d["kind"] == "Deployment"}
    assert {so["spec"]["scaleTargetRef"]["name"] for so in sos} <= deps
