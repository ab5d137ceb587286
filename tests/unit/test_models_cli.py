"""``actorserve models ...`` (control/ops/models_cli.py): parsing, manifest building, refusal rules; and the
supervisor's reconciliation of running model versions with the registry (no etcd, no processes)."""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import pytest

from control.ops import models_cli
from control.ops.cli import build_parser
from control.ops.models_cli import (RegistryCommandError, build_manifest, manifest_changes, parse_option,
                                retire_blocker)
from control.state.routing import RoutingTable, promote, start_rollout


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.fixture
def artifact(tmp_path):
    """A real tiny GGUF (registration reads its tensor table since [20]: a file with the magic alone is refused)."""
    from tests.engine_fixtures import write_tiny_llama_gguf

    p = str(tmp_path / "m.gguf")
    write_tiny_llama_gguf(p)
    return p


def test_a_file_with_the_magic_alone_is_refused_naming_it(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF" + b"\xff" * 160)
    with pytest.raises(RegistryCommandError, match="m.gguf"):
        build_manifest(_parse("models", "register", "tiny", "3", "--artifact", str(p)))


def test_register_parses_every_option(artifact):
    a = _parse("models", "register", "tiny", "2", "--artifact", artifact, "--quantization", "Q8_0",
               "--context-length", "512", "--memory-bytes", "1000", "--chat-template", "{{ messages }}",
               "--default", "temperature=0.7", "--default", "stop=END", "--default", 'stop=["a","b"]',
               "--option", "workers=2", "--option", 'test_faults={"error_rate":0.5}', "--replace",
               "--state-dir", "/tmp/s")
    assert a.func.__name__ == "_cmd_models_register" and a.replace and a.state_dir == "/tmp/s"
    m = build_manifest(a)
    assert m["name"] == "tiny" and m["version"] == "2" and m["artifact"] == artifact
    assert (m["format"], m["quantization"], m["context_length"], m["memory_bytes"]) == ("gguf", "Q8_0", 512, 1000)
    assert m["chat_template"] == "{{ messages }}" and m["status"] == "active"
    assert m["defaults"] == {"temperature": 0.7, "stop": ["a", "b"]}  # the last --default of a key wins
    assert m["workers"] == 2 and m["test_faults"] == {"error_rate": 0.5}  # options: extra manifest keys


def test_register_defaults_from_the_artifact(artifact, tmp_path):
    a = _parse("models", "register", "tiny", "3", "--artifact", artifact)
    m = build_manifest(a)
    from actors.worker.engine.loaded_bytes import loaded_bytes

    assert m["memory_bytes"] == loaded_bytes(artifact) > 0 and m["chat_template"] == "gguf"  # the loaded form
    assert m["defaults"] == {} and "workers" not in m
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    m = build_manifest(_parse("models", "register", "tiny", "3", "--artifact", artifact, "--chat-template", f"@{tpl}"))
    assert m["chat_template"].startswith("{% for m in messages")


def test_register_refusals_name_the_field(artifact, tmp_path, capsys):
    with pytest.raises(RegistryCommandError, match="format safetensors is not supported"):
        build_manifest(_parse("models", "register", "tiny", "2", "--artifact", artifact, "--format", "safetensors"))
    with pytest.raises(RegistryCommandError, match="artifact .* does not exist"):
        build_manifest(_parse("models", "register", "tiny", "2", "--artifact", str(tmp_path / "nope.gguf")))
    secret = tmp_path / "keys.out"
    secret.write_text("sk-as-secret-key-material\n")
    with pytest.raises(RegistryCommandError, match="is not a GGUF file") as ei:
        build_manifest(_parse("models", "register", "tiny", "2", "--artifact", str(secret)))
    assert "sk-as" not in str(ei.value)  # the file's bytes are never quoted
    with pytest.raises(RegistryCommandError, match="defaults.warmth"):
        build_manifest(_parse("models", "register", "tiny", "2", "--artifact", artifact, "--default", "warmth=1"))
    with pytest.raises(RegistryCommandError, match="defaults.top_k"):
        build_manifest(_parse("models", "register", "tiny", "2", "--artifact", artifact, "--default", "top_k=0.5"))
    with pytest.raises(RegistryCommandError, match="model version"):
        build_manifest(_parse("models", "register", "tiny", "v.2", "--artifact", artifact))
    with pytest.raises(RegistryCommandError, match="chat_template"):
        build_manifest(_parse("models", "register", "tiny", "2", "--artifact", artifact,
                              "--chat-template", f"@{tmp_path / 'missing.jinja'}"))
    for bad, field in (('{"min_worker": 1}', "autoscale.min_worker: unknown key"),  # a typo is not ignored
                       ('{"min_workers": -1}', "autoscale.min_workers"), ('{"min_workers": "2"}', "autoscale.min_workers"),
                       ('{"min_workers": 2, "max_workers": 1}', "autoscale.max_workers"),
                       ('{"scale_to_zero": 1}', "autoscale.scale_to_zero"), ("[1]", "autoscale must be an object")):
        with pytest.raises(RegistryCommandError, match=field):
            build_manifest(_parse("models", "register", "tiny", "2", "--artifact", artifact, "--option",
                                  f"autoscale={bad}"))
    ok = build_manifest(_parse("models", "register", "tiny", "2", "--artifact", artifact, "--option",
                               'autoscale={"min_workers": 1, "scale_to_zero": false, "ttft_slo_ms": 500}'))
    assert ok["autoscale"]["min_workers"] == 1
    # the verb itself: exit 2, message on stderr, before any etcd connection is attempted
    a = _parse("models", "register", "tiny", "2", "--artifact", artifact, "--format", "exl2", "--etcd",
               "http://127.0.0.1:1")
    assert a.func(a) == 2
    err = capsys.readouterr().err
    assert "format exl2 is not supported" in err and "models register" in err


@pytest.mark.parametrize("key", ["min_p", "repetition_penalty"])
def test_register_accepts_min_p_and_repetition_penalty_defaults_and_checks_them(artifact, capsys, key):
    m = build_manifest(_parse("models", "register", "tiny", "2", "--artifact", artifact, "--default", f"{key}=0.1"))
    assert m["defaults"] == {key: 0.1}  # honoured by the engine: stored like any other default
    a = _parse("models", "register", "tiny", "2", "--artifact", artifact, "--default", f"{key}=-1",
               "--etcd", "http://127.0.0.1:1")
    assert a.func(a) == 2  # a bad value is refused before any etcd connection: never stored
    assert f"defaults.{key} must be a number" in capsys.readouterr().err
    with pytest.raises(RegistryCommandError, match="defaults.temperature must be a number"):
        build_manifest(_parse("models", "register", "tiny", "2", "--artifact", artifact, "--default", "temperature=9"))


def test_option_parsing():
    assert parse_option("workers=2") == ("workers", 2)
    assert parse_option('pool="gpu"') == ("pool", "gpu")
    assert parse_option("test_faults={\"delay_ms\": 50}") == ("test_faults", {"delay_ms": 50})
    for bad in ("workers", "=2", "format=\"x\"", "status=\"retired\"", "pool=gpu", "a.b=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_option(bad)


def test_option_errors_exit_2(artifact, capsys):
    with pytest.raises(SystemExit) as ei:
        _parse("models", "register", "tiny", "2", "--artifact", artifact, "--option", "pool=gpu")
    assert ei.value.code == 2 and "not valid JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        _parse("models", "register", "tiny", "2")  # --artifact is required
    assert ei.value.code == 2 and "--artifact" in capsys.readouterr().err


def test_show_list_retire_parse():
    a = _parse("models", "show", "tiny", "--json", "--etcd", "http://e:1")
    assert a.func.__name__ == "_cmd_models_show" and a.name == "tiny" and a.json
    a = _parse("models", "list")
    assert a.func.__name__ == "_cmd_models_list" and not a.json
    a = _parse("models", "retire", "tiny", "2", "--force")
    assert a.func.__name__ == "_cmd_models_retire" and (a.name, a.version, a.force) == ("tiny", "2", True)
    assert not _parse("models", "retire", "tiny", "2").force


def test_manifest_changes_ignore_status():
    old = {"artifact": "/a", "format": "gguf", "status": "retired", "workers": 1}
    assert manifest_changes(old, {**old, "status": "active"}) == []
    assert manifest_changes(old, {"artifact": "/b", "format": "gguf", "status": "active"}) == ["artifact", "workers"]


def test_retire_blocker():
    assert retire_blocker("tiny", "2", None) is None  # no routing table: nothing pins a version
    t = RoutingTable(stable="1")
    assert "stable" in retire_blocker("tiny", "1", t.to_dict())
    assert retire_blocker("tiny", "2", t.to_dict()) is None
    r = start_rollout(t, stable="1", canary="2", weight=5)
    msg = retire_blocker("tiny", "2", r.to_dict())
    assert "canary" in msg and "rollout rollback tiny" in msg and "--force" in msg
    assert "stable" in retire_blocker("tiny", "1", r.to_dict())
    p = promote(r)
    assert retire_blocker("tiny", "1", p.to_dict()) is None and "stable" in retire_blocker("tiny", "2", p.to_dict())
    assert retire_blocker("tiny", "1", {"stable": "NOT VALID"}) is None


# -- supervisor: versions come and go --------------------------------------------------------


class _FakeProc:
    _next = 50000

    def __init__(self):
        _FakeProc._next += 1
        self.pid, self.returncode = _FakeProc._next, None

    def poll(self):
        return self.returncode


@pytest.fixture
def sup(tmp_path, monkeypatch):
    from control.ops.supervisor import Supervisor, manifest_fingerprint
    from control.ops.stack_config import StackConfig

    s = Supervisor(StackConfig(tmp_path, port=8100, workers=1, model_name="tiny", watch_registry=False))
    s.stack = SimpleNamespace(nats_url="nats://127.0.0.1:1", etcd_url="http://127.0.0.1:2",
                              nats=SimpleNamespace(running=False, pid=None, name="nats"),
                              etcd=SimpleNamespace(running=False, pid=None, name="etcd"))
    s.gateway_ports = [8100]
    s.terminated: list[str] = []

    def spawn(a):
        a.proc = _FakeProc()

    def terminate(group):
        for a in group:
            s.terminated.append(a.name)
            a.proc.returncode = 0

    monkeypatch.setattr(s.procs, "spawn", spawn)
    monkeypatch.setattr(s.procs, "terminate", terminate)
    s.procs.actors = s.factory.initial()
    for a in s.actors:
        s.procs.spawn(a)
    s.manifest = {"name": "tiny", "version": "1", "artifact": "/t.gguf", "format": "gguf", "status": "active"}
    s.versions.adopt("tiny@1", manifest_fingerprint(s.manifest))
    return s


def _m(version: str, status: str = "active", **extra):
    return {"name": "tiny", "version": version, "artifact": "/t.gguf", "format": "gguf", "status": status, **extra}


def test_reconcile_starts_and_drains_versions(sup):
    import json

    before = {a.name: a.pid for a in sup.actors}
    assert sup.reconcile({"tiny": {"1": sup.manifest}}) == ([], [])
    started, stopped = sup.reconcile({"tiny": {"1": sup.manifest, "2": _m("2", workers=2)}})
    assert (started, stopped) == (["tiny@2"], [])
    new = {a.name: a for a in sup.actors if a.model == "tiny@2"}
    assert set(new) == {"scheduler-tiny-2", "worker-tiny-2-0", "worker-tiny-2-1"}
    w = new["worker-tiny-2-1"]
    assert w.argv[w.argv.index("--worker-id") + 1] == "worker-tiny-2-1" and "tiny@2" in w.argv
    assert w.log_path.name == "worker-tiny-2-1.log" and w.dynamic
    assert {a.name: a.pid for a in sup.actors if a.model != "tiny@2"} == before  # nothing else restarted
    pids = json.loads((sup.state_dir / "pids.json").read_text())
    assert set(new) <= set(pids)
    assert sup.running_versions == ["tiny@1", "tiny@2"]

    # retired: drained (scheduler first), forgotten, pids.json rewritten; other actors untouched
    started, stopped = sup.reconcile({"tiny": {"1": sup.manifest, "2": _m("2", "retired", workers=2)}})
    assert (started, stopped) == ([], ["tiny@2"])
    assert sup.terminated == ["scheduler-tiny-2", "worker-tiny-2-0", "worker-tiny-2-1"]
    assert not [a for a in sup.actors if a.model == "tiny@2"] and sup.running_versions == ["tiny@1"]
    assert not set(new) & set(json.loads((sup.state_dir / "pids.json").read_text()))
    assert {a.name: a.pid for a in sup.actors} == before

    # re-registered with another manifest, then deleted; invalid manifests are never started
    assert sup.reconcile({"tiny": {"1": sup.manifest, "2": _m("2")}})[0] == ["tiny@2"]
    assert [a.name for a in sup.actors if a.model == "tiny@2"] == ["worker-tiny-2-0", "scheduler-tiny-2"]
    assert sup.reconcile({"tiny": {"1": sup.manifest, "2": _m("2", artifact="/other.gguf")}}) == (["tiny@2"], ["tiny@2"])
    assert sup.reconcile({"tiny": {"1": sup.manifest}, "x": {"1": {**_m("1"), "format": "onnx"}}}) == ([], ["tiny@2"])
    assert sup.running_versions == ["tiny@1"]


def test_reconcile_drains_the_initial_version_and_restarts_it_under_its_names(sup):
    assert sup.reconcile({"tiny": {}}) == ([], ["tiny@1"])
    assert sorted(sup.terminated) == ["scheduler-0", "worker-0"]
    assert sup.reconcile({"tiny": {"1": sup.manifest}}) == (["tiny@1"], [])
    assert sorted(a.name for a in sup.actors if a.model == "tiny@1") == ["scheduler-0", "worker-0"]


def test_reconcile_after_stop_does_nothing(sup):
    sup.procs.stopping = True
    assert sup.reconcile({"tiny": {"1": sup.manifest, "2": _m("2")}}) == ([], [])


def test_version_worker_count():
    from control.ops.supervisor import version_worker_count

    assert version_worker_count({"workers": 3}, 1) == 3
    assert version_worker_count({"workers": 0}, 1) == 0
    assert version_worker_count({}, 2) == 2
    assert version_worker_count({"workers": True}, 2) == 2 and version_worker_count({"workers": "3"}, 2) == 2


def test_models_cli_module_is_registered_in_one_call():
    import inspect

    from control.ops import cli

    src = inspect.getsource(cli.build_parser)
    assert "add_models_commands(sub)" in src and "register-default" not in src
    assert models_cli.add_models_commands.__doc__


def test_register_refuses_a_model_the_engine_cannot_account_for(tmp_path):
    """Issue [20]: an unknown tensor, a missing one or an unknown RoPE scaling type is refused at registration,
    naming it (GGUF: the tensor table read through a memory map; directory: config.json and safetensors headers)."""
    import numpy as np
    from safetensors.torch import load_file, save_file

    from tests import family_models as fm

    built = fm.build("llama-plain", tmp_path)
    extra = fm.write_gguf(built["model"], str(tmp_path / "extra.gguf"),
                          extra_tensors={"blk.0.attn_extra.weight": np.zeros((4, 4), np.float32)})
    yarn = fm.write_gguf(built["model"], str(tmp_path / "yarn.gguf"), rope_type="yarn")
    missing = fm.write_gguf(built["model"], str(tmp_path / "missing.gguf"), drop=("blk.1.ffn_up.weight",))
    for path, named in ((extra, "blk.0.attn_extra.weight"), (yarn, "yarn"), (missing, "blk.1.ffn_up.weight")):
        with pytest.raises(RegistryCommandError, match=named.replace(".", r"\.")):
            build_manifest(_parse("models", "register", "m", "1", "--artifact", path))
    assert build_manifest(_parse("models", "register", "m", "1", "--artifact", built["gguf"]))["format"] == "gguf"
    d = build_manifest(_parse("models", "register", "m", "1", "--artifact", built["hf"]))
    assert d["format"] == "hf" and d["tokenizer"] == "hf" and d["context_length"] == 128 and d["memory_bytes"] > 0
    weights = load_file(f"{built['hf']}/model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, f"{built['hf']}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RegistryCommandError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        build_manifest(_parse("models", "register", "m", "1", "--artifact", built["hf"]))


def test_up_model_file_takes_a_directory_or_a_gguf_checked_as_register_checks_them(tmp_path):
    """``up --model-file`` / ``register-default --model-file`` (deploy.model_manifest) infer the format from the
    path and check the artifact through the same code as ``models register`` (control/ops/artifacts.py)."""
    import shutil

    import numpy as np
    from safetensors.torch import load_file, save_file

    from control.ops.deploy import model_manifest
    from control.state.registry import ModelManifest
    from tests import family_models as fm

    built = fm.build("qwen2", tmp_path)
    m = model_manifest("q", "1", built["hf"])
    ModelManifest.from_dict(m)  # valid for the registry
    assert (m["format"], m["tokenizer"], m["chat_template"], m["quantization"]) == ("hf", "hf", "gguf", None)
    assert m["artifact"] == os.path.abspath(built["hf"]) and m["context_length"] == 128
    reg = build_manifest(_parse("models", "register", "q", "1", "--artifact", built["hf"]))
    for key in ("artifact", "format", "tokenizer", "context_length", "memory_bytes", "quantization"):
        assert m[key] == reg[key], key  # the same facts as `models register`
    assert model_manifest("q", "1", built["hf"], context_length=64)["context_length"] == 64
    g = model_manifest("q", "1", built["gguf"])
    from actors.worker.engine.loaded_bytes import loaded_bytes

    assert (g["format"], g["tokenizer"], g["memory_bytes"]) == ("gguf", "gguf", loaded_bytes(built["gguf"]))
    # refusals name the tensor or file, as at registration
    extra = fm.write_gguf(built["model"], str(tmp_path / "extra.gguf"),
                          extra_tensors={"blk.0.attn_extra.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(ValueError, match=r"blk\.0\.attn_extra\.weight"):
        model_manifest("q", "1", extra)
    no_tok = tmp_path / "no-tok"
    shutil.copytree(built["hf"], no_tok)
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        model_manifest("q", "1", no_tok)
    weights = load_file(f"{built['hf']}/model.safetensors")
    del weights["model.layers.0.self_attn.q_proj.bias"]
    save_file(weights, f"{built['hf']}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        model_manifest("q", "1", built["hf"])
    with pytest.raises(FileNotFoundError):
        model_manifest("q", "1", tmp_path / "nowhere")
