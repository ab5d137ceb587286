"""Lending across models, live (issue [29] item 1; actors/autoscaler/lend_carry.py): ``up --workers 1
--multi-model --lend`` (real nats-server, etcd, supervisor, autoscaler, schedulers, gateway, one host), tiny
random-weight models.

The autoscaler takes an idle version to zero and puts its replica to sleep on the host (KV cache freed, weights
kept); a version registered with a floor of one replica is then loaded on that host by the autoscaler -- a lend
of the sleeper's room, decided by the simulator's lending rule -- before any request for it arrives, and the
decision log says so. Every request succeeds after.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from control.state.registry import Registry
from tests.e2e.helpers import tiny_deployment, wait_until
from tests.e2e.test_model_host import ENGINE, chat, rows_when
from tests.e2e.test_registry_live import cli


def decisions(sup) -> list[dict]:
    from control.state.names import autoscaler_decisions_key

    async def read():
        async with Registry.connect(sup.etcd_url) as reg:
            return await reg.get_json(autoscaler_decisions_key())
    got = asyncio.run(read())
    return list((got or {}).get("decisions", [])) if isinstance(got, dict) else list(got or [])


@pytest.mark.slow  # 20-50 s: in `make test-slow` (CI runs it after `make test`) to keep `make test` under 20 min
def test_the_autoscaler_lends_an_idle_versions_sleeping_host_to_a_version_short_of_replicas(tmp_path, tiny_gguf):
    from tests.engine_fixtures import write_tiny_llama_gguf

    other = write_tiny_llama_gguf(str(tmp_path / "other.gguf"), seed=7)
    floor = 4 * 2**20
    budget = 2**20 + floor + floor // 2  # both weights and one KV cache; never two KV caches
    args = {"worker": ENGINE + ["--kv-floor-bytes", str(floor), "--kv-cache-bytes", str(floor),
                                "--memory-budget-bytes", str(budget)],
            "autoscaler": ["--tick-s", "0.5", "--policy-set", "pool.idle_to_zero_s=2"]}
    with tiny_deployment(tmp_path / "state", tiny_gguf, args, multi_model=True, autoscaler=True, lend=True) as sup:
        pids = json.loads((sup.state_dir / "pids.json").read_text())
        assert "autoscaler-0" in pids and "worker-0" in pids
        assert chat(sup, "tiny").status_code == 200
        # idle for 2 s: tiny@1 goes to zero, and the sleeping tier keeps its replica asleep (wanted again: it
        # served within the history window), on the host, its KV cache freed
        asleep = rows_when(sup, lambda r: r["tiny@1"]["state"] == "sleeping", "tiny@1 asleep by the autoscaler", 60)
        assert asleep["loads"] == 1

        manifest_floor = '{"min_workers": 1, "max_workers": 1, "scale_to_zero": false}'
        assert cli(sup, "models", "register", "other", "1", "--artifact", other,
                   "--option", f"autoscale={manifest_floor}").returncode == 0
        # no request for other@1: the autoscaler wants 1 replica (its floor), finds tiny@1 asleep on the host
        # and lends that host (a load on a running host, not a cold start)
        lent = rows_when(sup, lambda r: set(r) == {"tiny@1", "other@1"} and r["other@1"]["state"] == "serving",
                         "other@1 loaded by a lend", 60)
        rows = {r["model"]: r for r in lent["resident"]}
        assert rows["tiny@1"]["state"] == "sleeping" and rows["other@1"]["kv_bytes"] >= floor, lent
        assert lent["loads"] == 2 and lent["evictions"] == 0 and lent["held_bytes"] <= budget
        wait_until(lambda: any(d["loop"] == "lend" for d in decisions(sup)), 15, "the lend in the decision log")
        lends = [d for d in decisions(sup) if d["loop"] == "lend"]
        assert lends[0]["target"] == "worker/other/1/local" and lends[0]["inputs"]["lent_from"] == "tiny@1", lends
        assert lends[0]["inputs"]["host"] == lent["host_id"] and "cold start" in lends[0]["reason"]

        for model in ("other", "tiny"):  # the lent replica serves; the sleeper wakes into the host's room
            r = chat(sup, model, timeout=120)
            assert r.status_code == 200, (model, r.status_code, r.text[:300])
