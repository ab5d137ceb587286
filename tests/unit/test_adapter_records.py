"""LoRA adapter records (control/state/adapters.py) and their resolution in the gateway (gateway/models.py):
``name:adapter`` goes to the version the adapter was registered for whatever the canary split says; tenant
scoping, retired adapters and version mismatches answer 404; ``/v1/models`` lists adapters with ``parent``."""

import json
import uuid

import pytest

from control.state import adapters as a
from control.state import routing as r
from gateway.models import ModelSnapshot
from gateway.openai_format import ApiError


def _snap(adapters: dict, table=None) -> ModelSnapshot:
    vers = {"m": {"1": {"status": "active"}, "2": {"status": "active"}}}
    return ModelSnapshot(vers, {"m": table.to_dict() if table else {}}, {("m", "1"): 1, ("m", "2"): 1},
                         0.0, {"m": adapters})


def _rec(name: str, version: str = "1", tenants=(), status: str = "active") -> dict:
    rec = a.adapter_record(name, "m", version, "/abs/" + name, tenants, 8, 16.0, now=1.0)
    return rec if status == "active" else a.retired(rec, now=2.0)


def test_adapter_goes_to_its_version_whatever_the_canary_split():
    t = r.start_rollout(r.RoutingTable(), stable="1", canary="2", weight=100)  # every base request to 2
    snap = _snap({"sql": _rec("sql", "1")}, t)
    assert snap.resolve("m", tenant="t", request_key="k")[1] == "2"
    got = {snap.resolve_ref("m:sql", tenant="t", request_key=uuid.uuid4().hex) for _ in range(200)}
    rid = a.adapter_id(snap.adapters["m"]["sql"])
    assert got == {("m", "1", rid)} and rid.startswith("sql~") and a.display_name(rid) == "sql"
    assert snap.resolve_ref("m@1:sql") == ("m", "1", rid) and snap.adapter_path("m", rid) == "/abs/sql"


def test_registering_a_name_again_gives_a_new_id():
    """A new revision: workers read the files anew and the prefix cache salt (which covers the id) changes."""
    first, again = _rec("sql"), _rec("sql")
    assert a.adapter_id(first) != a.adapter_id(again)
    assert a.adapter_id({"adapter": "old"}) == "old"  # a record written before revisions


@pytest.mark.parametrize("ref,tenant,recs", [
    ("m@2:sql", "t", {"sql": _rec("sql", "1")}),  # registered for another version
    ("m:sql", "other", {"sql": _rec("sql", "1", tenants=["t"])}),  # tenant not on its list
    ("m:sql", "t", {"sql": _rec("sql", "1", status="retired")}),
    ("m:nope", "t", {"sql": _rec("sql", "1")}),
    ("m:sql", "t", {"sql": _rec("sql", "3")}),  # its version is not active
])
def test_not_found_like_an_unknown_model(ref, tenant, recs):
    with pytest.raises(ApiError) as e:
        _snap(recs).resolve_ref(ref, tenant=tenant)
    assert e.value.status == 404 and e.value.code == "model_not_found"


def test_model_list_shows_visible_adapters_with_parent():
    snap = _snap({"sql": _rec("sql", "2"), "mine": _rec("mine", "1", tenants=["t"]),
                  "old": _rec("old", "1", status="retired")})
    ids = {m["id"]: m for m in snap.model_list("other")}
    assert ids["m:sql"]["parent"] == "m@2" and "m:mine" not in ids and "m:old" not in ids
    assert {"m:sql", "m:mine"} <= set(m["id"] for m in snap.model_list("t"))


def test_served_by_lists_active_adapters_of_one_version():
    recs = {"x": _rec("x", "1"), "y": _rec("y", "2"), "z": _rec("z", "1", status="retired")}
    assert a.served_by(recs, "1") == {a.adapter_id(recs["x"]): "/abs/x"}


def test_record_and_peft_dir_checks_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="absolute"):
        a.adapter_record("x", "m", "1", "rel/dir")
    with pytest.raises(ValueError, match="adapter name"):
        a.adapter_record("Bad:Name", "m", "1", "/abs")
    with pytest.raises(ValueError, match="adapter_config.json"):
        a.check_peft_dir(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 0}))
    with pytest.raises(ValueError, match="r must be"):
        a.check_peft_dir(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        a.check_peft_dir(str(tmp_path))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match="adapter_model.safetensors: unreadable"):
        a.check_peft_dir(str(tmp_path))
    import numpy as np
    from safetensors.numpy import save_file
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({key: np.zeros((4, 8), np.float32), "base_model.model.lm_head.lora_A.weight": np.zeros((4, 8), np.float32)},
              str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.lora_A.weight' is not a LoRA A/B"):
        a.check_peft_dir(str(tmp_path))
    save_file({key: np.zeros((4, 8), np.float32)}, str(tmp_path / "adapter_model.safetensors"))
    assert a.check_peft_dir(str(tmp_path)) == {"rank": 4, "alpha": 8.0}
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        a.check_peft_dir(str(tmp_path))
