"""The Kubernetes kustomize base deploy/k8s/base (issue 21 item 3): every document validated strictly with
kubernetes-validate against recent Kubernetes versions, and the cross-references no schema checks (probes,
Secrets and ConfigMaps that exist, PDB and Service selectors that match, one Deployment per actor kind, each
connecting as its own NATS role, NATS and etcd clusters of three, no Kubernetes API rights for any actor).

Rendered with ``kubectl kustomize`` when kubectl is installed (and compared with the plain files), else the
resources listed in kustomization.yaml are loaded directly (the base has no generators or transformers).
Cost: ~1-3 s (schema loading dominates).
"""

from __future__ import annotations

import base64
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from actors.kinds import ACTOR_MODULES, MODEL_ACTORS  # noqa: E402
from control.ops.cli import build_parser  # noqa: E402
from control.ops.nats_roles import ROLES, role_of_kind  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "k8s" / "base"
VERSIONS = ("1.30.0", "1.37.0")  # the oldest and the newest schema set kept by kubernetes-validate here


def _load_module(name: str, rel: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _load_module("actorserve_gen_nats_conf", "deploy/gen_nats_conf.py")


def load_base() -> list[dict]:
    """The documents of every resource file listed in kustomization.yaml, in order."""
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    extra = set(kust) - {"apiVersion", "kind", "resources"}
    assert not extra, f"kustomization.yaml uses {extra}: the plain-file loader of this test would differ"
    docs = []
    for rel in kust["resources"]:
        docs += [d for d in yaml.safe_load_all((BASE / rel).read_text()) if d]
    return docs


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return load_base()


def _by(docs, kind) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _pod_templates(docs) -> dict[tuple[str, str], dict]:
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            out[(d["kind"], d["metadata"]["name"])] = d["spec"]["template"]
        elif d["kind"] == "Job":
            out[("Job", d["metadata"]["name"])] = d["spec"]["template"]
    return out


def _matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_kustomize_render_equals_the_listed_files(docs):
    kubectl = shutil.which("kubectl") or shutil.which("kustomize")
    if kubectl is None:
        pytest.skip("neither kubectl nor kustomize is installed: the plain files are checked instead")
    cmd = [kubectl, "kustomize", str(BASE)] if kubectl.endswith("kubectl") else [kubectl, "build", str(BASE)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(rendered, key=key) == sorted(docs, key=key)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_document_validates_strictly(docs, version):
    errors = []
    for d in docs:
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{d['kind']}/{d['metadata']['name']}: {e.message} at {list(e.path)}")
    assert not errors, "\n".join(errors)


def test_names_are_unique(docs):
    seen = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(seen) == len(set(seen)), [s for s in seen if seen.count(s) > 1]


def _of_kind(docs, kind) -> list[tuple[str, dict]]:
    """(name, Deployment) of an actor kind: ``actorserve-<kind>``, or per model version (and pool) for schedulers
    and workers (``actorserve-<kind>-<model>-<version>[-<pool>]``, rendered by ``actorserve deploy k8s``)."""
    return [(n, d) for n, d in _by(docs, "Deployment").items()
            if d["spec"]["template"]["metadata"]["labels"].get("actorserve.io/actor-kind") == kind]


def test_one_deployment_per_actor_kind_connecting_as_its_role(docs):
    deps = _by(docs, "Deployment")
    for kind in ACTOR_MODULES:
        found = _of_kind(docs, kind)
        assert found, f"no Deployment for actor kind {kind}"
        if kind in MODEL_ACTORS:
            assert all(n.startswith(f"actorserve-{kind}-") for n, _ in found)
        else:
            assert [n for n, _ in found] == [f"actorserve-{kind}"]
        for name, dep in found:
            pod = dep["spec"]["template"]
            assert pod["metadata"]["labels"]["actorserve.io/actor-kind"] == kind
            (c,) = pod["spec"]["containers"]
            args = c["args"]
            assert args[:2] == ["actor", kind], args
            parsed = build_parser().parse_args(args)
            assert parsed.nats is None and parsed.etcd == "http://actorserve-etcd:2379", name
            role = role_of_kind(kind)
            env = {e["name"]: e for e in c["env"]}
            assert env["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "actorserve-nats-roles", "key": role}
            assert env["ACTORSERVE_NATS"]["value"] == f"nats://actorserve-{role}:$(NATS_PASSWORD)@actorserve-nats:4222"
            assert not any("PASSWORD" in a or "dev-only" in a for a in args), f"{name}: a secret in argv"
            replicas = _by(docs, "StatefulSet")["actorserve-nats"]["spec"]["replicas"]
            assert env["ACTORSERVE_JS_REPLICAS"]["value"] == str(replicas), f"{name}: JetStream replicas"
    kinds = {d["spec"]["template"]["metadata"]["labels"].get("actorserve.io/actor-kind") for d in deps.values()}
    extra = kinds - set(ACTOR_MODULES)
    assert not extra, f"Deployments of no actor kind: {extra}"


def test_probes_resources_and_non_root(docs):
    for (kind, name), pod in _pod_templates(docs).items():
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for c in spec["containers"]:
            res = c.get("resources") or {}
            assert res.get("requests", {}).get("cpu") and res.get("requests", {}).get("memory"), f"{name}: requests"
            assert res.get("limits", {}).get("memory"), f"{name}: memory limit"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            if kind == "Job":
                continue
            ready, live = c.get("readinessProbe"), c.get("livenessProbe")
            assert ready and live, f"{name}: readiness and liveness probes"
            if kind == "Deployment":
                http = ready.get("httpGet")
                assert (http and http["path"] == "/readyz") or ready.get("exec"), f"{name}: readiness on /readyz or exec"
                if ready.get("exec"):
                    cmd = ready["exec"]["command"]
                    assert cmd[0] == "actorserve-probe" and cmd[-1] == "http://127.0.0.1:9100/metrics", cmd
                    assert "--metrics-port" in c["args"] and c["args"][c["args"].index("--metrics-port") + 1] == "9100"
    gw = _by(docs, "Deployment")["actorserve-gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert gw["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for _, dep in _of_kind(docs, "worker"):
        worker = dep["spec"]["template"]["spec"]["containers"][0]
        assert "--require" in worker["readinessProbe"]["exec"]["command"], "a worker is ready once its engine serves"


def test_every_referenced_secret_and_configmap_exists(docs):
    secrets, configmaps = _by(docs, "Secret"), _by(docs, "ConfigMap")
    refs = 0
    for (_, name), pod in _pod_templates(docs).items():
        for c in pod["spec"]["containers"]:
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    refs += 1
                    assert ref["name"] in secrets, f"{name}: Secret {ref['name']} does not exist"
                    assert ref["key"] in secrets[ref["name"]]["stringData"], f"{name}: {ref['name']} has no {ref['key']}"
                ref = (e.get("valueFrom") or {}).get("configMapKeyRef")
                if ref:
                    assert ref["name"] in configmaps, name
            for src in c.get("envFrom") or []:
                if "secretRef" in src:
                    assert src["secretRef"]["name"] in secrets, name
        for v in pod["spec"].get("volumes") or []:
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets, name
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, name
        sa = pod["spec"].get("serviceAccountName")
        if sa:
            assert sa in _by(docs, "ServiceAccount"), f"{name}: ServiceAccount {sa}"
    assert refs >= len(ACTOR_MODULES) + len(ROLES) + 1
    assert set(secrets["actorserve-nats-roles"]["stringData"]) == set(ROLES) | {"operator"}
    for value in (v for s in secrets.values() for v in s["stringData"].values()):
        assert value.startswith("dev-only-change-me"), "a Secret in the base must be a marked dev placeholder"


def test_pdbs_and_services_select_pods(docs):
    pods = _pod_templates(docs)
    labels = {k: p["metadata"]["labels"] for k, p in pods.items()}
    pdbs = _by(docs, "PodDisruptionBudget")
    for (kind, name), lab in labels.items():
        if kind == "Job":
            continue
        sel = [p for p in pdbs.values() if _matches(p["spec"]["selector"]["matchLabels"], lab)]
        assert len(sel) == 1, f"{kind}/{name} is covered by {len(sel)} PodDisruptionBudgets"
    for name, pdb in pdbs.items():
        assert any(_matches(pdb["spec"]["selector"]["matchLabels"], lab) for lab in labels.values()), name
    for (kind, name), pod in pods.items():
        if kind in ("Deployment", "StatefulSet"):
            ctrl = _by(docs, kind)[name]
            assert _matches(ctrl["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"]), name
    for name, svc in _by(docs, "Service").items():
        targets = [(k, p) for k, p in pods.items() if _matches(svc["spec"]["selector"], p["metadata"]["labels"])]
        assert targets, f"Service {name} selects no pod"
        for port in svc["spec"]["ports"]:
            tp = port.get("targetPort", port["port"])
            for _, p in targets:
                names = {cp.get("name") for c in p["spec"]["containers"] for cp in c.get("ports") or []}
                nums = {cp["containerPort"] for c in p["spec"]["containers"] for cp in c.get("ports") or []}
                assert tp in names or tp in nums, f"Service {name}: targetPort {tp} is no container port"


def test_nats_cluster_of_three_with_the_generated_config(docs):
    sts = _by(docs, "StatefulSet")["actorserve-nats"]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == "actorserve-nats-headless"
    assert gen.K8S_CONFIGMAP not in gen.stale(), "deploy/k8s/base/nats-config.yaml is stale: run deploy/gen_nats_conf.py"
    conf = _by(docs, "ConfigMap")["actorserve-nats-config"]["data"]["nats.conf"]
    routes = re.findall(r"nats://([a-z0-9-]+)-(\d)\.([a-z0-9-]+):6222", conf)
    assert routes == [("actorserve-nats", str(i), "actorserve-nats-headless") for i in range(3)]
    assert "jetstream {" in conf and "server_name: $POD_NAME" in conf
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["valueFrom"] for e in c["env"]}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    for role, var in gen.password_envs().items():
        assert env[var] == {"secretKeyRef": {"name": "actorserve-nats-roles", "key": role}}
        assert f"${var}" in conf


def test_etcd_cluster_of_three(docs):
    sts = _by(docs, "StatefulSet")["actorserve-etcd"]
    assert sts["spec"]["replicas"] == 3
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    flags = dict(a.split("=", 1) for a in c["command"][1:])
    members = dict(m.split("=", 1) for m in flags["--initial-cluster"].split(","))
    hl = sts["spec"]["serviceName"]
    assert members == {f"actorserve-etcd-{i}": f"http://actorserve-etcd-{i}.{hl}:2380" for i in range(3)}
    assert flags["--name"] == "$(POD_NAME)" and flags["--initial-cluster-state"] == "new"


def test_init_job_runs_the_compose_init_script(docs):
    job = _by(docs, "Job")["actorserve-init"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    script = c["args"][0]
    assert "actorserve models register-default" in script and "actorserve tenants create" in script
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["init"]["command"][0]
    assert script == compose.replace("$$", "$"), "the Job and the compose init run the same script"


def test_no_pod_gets_kubernetes_api_rights(docs):
    """No actor calls the Kubernetes API ([27] 3: KEDA carries out the autoscaler's counts): no Role or binding,
    one ServiceAccount whose token no pod mounts, and no annotation promising that the autoscaler patches
    replicas."""
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")]
    (sa,) = _by(docs, "ServiceAccount").values()
    assert sa["automountServiceAccountToken"] is False
    for (kind, name), pod in _pod_templates(docs).items():
        if kind == "StatefulSet":  # NATS and etcd: the namespace's default account, bound to nothing here
            continue
        assert pod["spec"]["serviceAccountName"] == sa["metadata"]["name"], name
        assert pod["spec"].get("automountServiceAccountToken") is False, name
    for d in _by(docs, "Deployment").values():
        assert not any(k.startswith("actorserve.io/") for k in (d["metadata"].get("annotations") or {})), d
    text = "\n".join(p.read_text() for p in BASE.rglob("*.yaml"))
    assert "spec.replicas" not in text and "patch" not in text


def test_the_autoscaler_exports_its_counts_to_prometheus(docs):
    (name, dep), = _of_kind(docs, "autoscaler")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(c["args"])
    assert args.metrics_host == "0.0.0.0", "Prometheus scrapes the desired counts KEDA follows"
    for kind in set(ACTOR_MODULES) - {"autoscaler", "gateway"}:
        for _, other in _of_kind(docs, kind):
            assert "--metrics-host" not in other["spec"]["template"]["spec"]["containers"][0]["args"], kind


def test_make_secrets_replaces_every_placeholder_with_random_values(docs):
    if shutil.which("kubectl") is None:
        pytest.skip("deploy/k8s/make-secrets.sh needs kubectl (client only), not installed here")
    run = lambda: subprocess.run(["sh", str(ROOT / "deploy/k8s/make-secrets.sh")], capture_output=True,  # noqa: E731
                                 text=True, timeout=30, check=True).stdout
    made = {d["metadata"]["name"]: d for d in yaml.safe_load_all(run()) if d}
    base = _by(docs, "Secret")
    assert set(made) == set(base)
    for name, d in made.items():
        kubernetes_validate.validate(d, VERSIONS[-1], strict=True)
        assert set(d["data"]) == set(base[name]["stringData"]), name
        values = [base64.b64decode(v).decode() for v in d["data"].values()]
        assert all(re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{23,}", v) for v in values), "nats-server-safe values"
        assert d["metadata"]["labels"] == base[name]["metadata"]["labels"]
    again = {d["metadata"]["name"]: d for d in yaml.safe_load_all(run()) if d}
    assert all(made[n]["data"][k] != again[n]["data"][k] for n in made for k in made[n]["data"])
