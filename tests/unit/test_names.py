import pytest

from control.state import names
from control.state.names import ModelRef, parse_model_ref, validate_name


@pytest.mark.parametrize("value", ["a", "0", "smollm2", "llama-3_8b", "v1", "a" * 128])
def test_valid_names(value):
    assert validate_name("model name", value) == value
    assert names.is_valid_name(value)


@pytest.mark.parametrize(
    "value", ["", "A", "-a", "_a", "a.b", "a/b", "a b", "a@b", "a:b", "é", "a" * 129, None, 3, "a\n"]
)
def test_invalid_names(value):
    with pytest.raises(ValueError):
        validate_name("model name", value)
    assert not names.is_valid_name(value)


def test_error_names_the_kind():
    with pytest.raises(ValueError, match="tenant id"):
        validate_name("tenant id", "Bad")


@pytest.mark.parametrize(
    "ref, expected",
    [
        ("m", ModelRef("m")),
        ("m@v1", ModelRef("m", "v1")),
        ("m:ad", ModelRef("m", None, "ad")),
        ("m@v1:ad", ModelRef("m", "v1", "ad")),
        ("smollm2-135m@2024-11_q4:sql-lora", ModelRef("smollm2-135m", "2024-11_q4", "sql-lora")),
    ],
)
def test_parse_model_ref_roundtrip(ref, expected):
    parsed = parse_model_ref(ref)
    assert parsed == expected
    assert str(parsed) == ref
    assert parse_model_ref(str(parsed)) == parsed


@pytest.mark.parametrize(
    "ref", ["", "@v1", "m@", "m:", "m@v1@v2", "m:a:b", "m@:a", "M@v1", "m@v.1", "m:a.b", ":a"]
)
def test_parse_model_ref_rejects(ref):
    with pytest.raises(ValueError):
        parse_model_ref(ref)


def test_model_ref_frozen_and_with_version():
    r = parse_model_ref("m:ad")
    with pytest.raises(Exception):
        r.name = "x"  # type: ignore[misc]
    assert str(r.with_version("v2")) == "m@v2:ad"


def test_keys():
    assert names.models_prefix() == "/actorserve/models/"
    assert names.model_versions_prefix("m") == "/actorserve/models/m/versions/"
    assert names.model_version_key("m", "v1") == "/actorserve/models/m/versions/v1"
    assert names.routing_key("m") == "/actorserve/models/m/routing"
    assert names.tenant_key("t1") == "/actorserve/tenants/t1"
    assert names.workers_prefix("m", "v1") == "/actorserve/workers/m/v1/"
    assert names.worker_key("m", "v1", "w-1") == "/actorserve/workers/m/v1/w-1"
    assert names.scheduler_key("m", "v1") == "/actorserve/schedulers/m/v1"
    assert names.pool_key("cpu") == "/actorserve/pools/cpu"
    assert names.model_version_key("m", "v1").startswith(names.model_versions_prefix("m"))
    assert names.worker_key("m", "v1", "w").startswith(names.workers_prefix("m", "v1"))


@pytest.mark.parametrize(
    "fn, args",
    [
        (names.model_version_key, ("m", "../x")),
        (names.model_version_key, ("M", "v1")),
        (names.routing_key, ("a/b",)),
        (names.tenant_key, ("",)),
        (names.worker_key, ("m", "v1", "w/x")),
        (names.scheduler_key, ("m", "v.1")),
        (names.pool_key, ("Cpu",)),
    ],
)
def test_key_builders_validate(fn, args):
    with pytest.raises(ValueError):
        fn(*args)


def test_split_key():
    assert names.split_key("/actorserve/workers/m/v1/w", names.all_workers_prefix()) == ["m", "v1", "w"]
    with pytest.raises(ValueError):
        names.split_key("/other/x", names.all_workers_prefix())
