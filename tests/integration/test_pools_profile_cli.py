"""``actorserve pools`` and ``actorserve profile`` against real etcd (control/ops/pools_cli.py,
profile_cli.py): pool records written and merged, listed; a throughput curve measured with our engine on the
tiny test model and stored at profile_key(name, version, pool)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from control.policy.curves import ThroughputCurve
from bench.engine_bench import cpu_model
from control.state import names
from tests.engine_fixtures import write_tiny_llama_gguf

REPO = Path(__file__).resolve().parents[2]


def _cli(infra, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ACTORSERVE_ETCD": infra.etcd_url, "ACTORSERVE_NATS": infra.nats_url}
    return subprocess.run([sys.executable, "-m", "control.ops.cli", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def _cli_here(infra, *argv: str) -> tuple[int, str, str]:
    """The CLI in this process (in a thread: it runs its own event loop): (exit status, stdout, stderr)."""
    from control.ops.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([*argv, "--etcd", infra.etcd_url])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


async def test_pools_set_merges_and_lists(infra, registry):
    name = f"gpu-{uuid.uuid4().hex[:6]}"
    rc, out, err = await asyncio.to_thread(
        _cli_here, infra, "pools", "set", name, "--accelerator", "h100", "--memory-bytes", str(80 * 2**30),
        "--price-on-demand-per-h", "4.5", "--price-spot-per-h", "1.8", "--market", "spot",
        "--preemption-rate-per-h", "0.2", "--max-workers", "8")
    assert rc == 0, err
    want = {"accelerator": "h100", "memory_bytes": 80 * 2**30, "price_on_demand_per_h": 4.5,
            "price_spot_per_h": 1.8, "market": "spot", "preemption_rate_per_h": 0.2, "max_workers": 8}
    assert await registry.get_json(names.pool_key(name)) == want
    rc, out, _ = await asyncio.to_thread(_cli_here, infra, "pools", "set", name, "--max-workers", "4")
    assert rc == 0 and "updated" in out  # only that field changes
    assert await registry.get_json(names.pool_key(name)) == {**want, "max_workers": 4}
    rc, out, _ = await asyncio.to_thread(_cli_here, infra, "pools", "list", "--json")
    assert rc == 0 and json.loads(out)[name]["max_workers"] == 4
    rc, out, _ = await asyncio.to_thread(_cli_here, infra, "pools", "list")
    assert rc == 0 and name in out and "h100" in out
    rc, _, err = await asyncio.to_thread(_cli_here, infra, "pools", "set", name, "--market", "reserved")
    assert rc == 2 and "invalid choice" in err  # argparse refuses it
    r = await asyncio.to_thread(_cli, infra, "pools", "list")  # the console entry, as a user runs it
    assert r.returncode == 0 and name in r.stdout


async def test_profile_measures_and_stores_the_curve(infra, registry, tmp_path):
    model, version = f"tiny-{uuid.uuid4().hex[:6]}", "1"
    path = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"))
    await registry.put_model_version(model, version, {"artifact": path, "format": "gguf"})
    out = tmp_path / "curve.json"
    r = await asyncio.to_thread(_cli, infra, "profile", f"{model}@{version}", "--pool", "local", "--batches", "1,2",
                                "--prompts", "8,16", "--decode-prompt-tokens", "8", "--decode-tokens", "6",
                                "--threads", "1", "--dtype", "float32", "--quantization", "none", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert cpu_model() in r.stdout and "ITL ms" in r.stdout and "TTFT ms" in r.stdout
    stored = await registry.get_json(names.profile_key(model, version, "local"))
    curve = ThroughputCurve.from_json(stored)
    assert [p.batch for p in curve.decode] == [1, 2] and [p.prompt_tokens for p in curve.prefill] == [8, 16]
    assert curve.cpu == cpu_model() and curve.meta["threads"] == 1 and curve.meta["model"] == f"{model}@{version}"
    assert curve.meta["device"] == "cpu" and curve.meta["dtype"] == "float32"
    for p in curve.decode:
        assert p.tokens_per_s > 0 and abs(p.itl_ms - 1000 * p.batch / p.tokens_per_s) < 1e-6
    assert all(p.ttft_ms > 0 for p in curve.prefill)
    assert curve.capacity_tokens_per_s(1e6) == curve.decode[-1].tokens_per_s
    assert json.loads(out.read_text()) == stored
    r = await asyncio.to_thread(_cli, infra, "profile", f"{model}@9", "--no-store")
    assert r.returncode == 1 and "no model version" in r.stderr
