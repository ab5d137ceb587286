"""Pure parts of tenancy: keys and hashes, tenant records, bearer parsing, quota windows, body hashes."""

from __future__ import annotations

import pytest

from bus.messages import CompletionRecord
from control.state.tenants import Tenant, TenantError, hash_key, key_matches, new_api_key, parse_bearer
from gateway.auth import unauthorized
from gateway.idempotency import body_hash, record_key
from gateway.quotas import _fmt_reset, _headers, rpm_take, window_sum
from gateway.usage import is_primary


def test_keys_are_random_and_stored_hashed():
    (id1, k1), (id2, k2) = new_api_key(), new_api_key()
    assert k1 != k2 and id1 != id2 and k1.startswith("sk-as-") and len(k1) >= 40
    assert hash_key(k1).startswith("sha256:") and k1 not in hash_key(k1)
    assert key_matches(k1, hash_key(k1)) and not key_matches(k2, hash_key(k1))


def test_parse_bearer():
    assert parse_bearer("Bearer abc") == "abc"
    assert parse_bearer("bearer  abc ") == "abc"
    for bad in (None, "", "Basic abc", "Bearer", "Bearer a b"):
        assert parse_bearer(bad) is None
    assert unauthorized(None).status == 401 and unauthorized("sk-as-secretsecret").code == "invalid_api_key"
    assert "secretsecret" not in unauthorized("sk-as-secretsecretxyz").message


def test_tenant_record_round_trip_and_validation():
    t = Tenant.from_record("acme", {"keys": {"k1": {"hash": "sha256:aa"}, "k2": {"revoked": 1.0}},
                                    "quotas": {"rpm": 5}, "allowed_models": ["m"]})
    assert t.active_key_hashes() == {"sha256:aa": "k1"}
    assert t.quota("rpm") == 5 and t.quota("tpm") is None
    assert t.allows_model("m") and not t.allows_model("other")
    assert not Tenant.from_record("x", {}).allows_model("m")  # empty allow-list = none
    assert Tenant.from_record("acme", t.to_record()) == t
    with pytest.raises(TenantError):
        Tenant.from_record("x", {"quotas": {"rpm": -1}})
    with pytest.raises(TenantError):
        Tenant.from_record("x", {"priority": "urgent"})


def test_sliding_window_admits_exactly_limit():
    v: dict = {}
    admitted = 0
    for i in range(300):  # 5 requests per second for 60 s
        new = rpm_take(v, 100, 1000.0 + i * 0.2)
        if new is not None:
            admitted += 1
            v = new
    assert admitted == 100
    total, kept, oldest = window_sum(v["b"], 1000.0 + 59.9)
    assert total == 100 and oldest == 1000
    assert window_sum(v["b"], 1000.0 + 60.0)[0] < 100  # the oldest second left the window
    assert _fmt_reset(0.2) == "1s" and _fmt_reset(61) == "1m1s"
    assert set(_headers("requests", 10, 3, 5)) == {"x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                                                   "x-ratelimit-reset-requests"}


def test_idempotency_hashes():
    assert body_hash("chat", {"a": 1, "b": [1, 2]}) == body_hash("chat", {"b": [1, 2], "a": 1})
    assert body_hash("chat", {"a": 1}) != body_hash("completions", {"a": 1})
    assert record_key("t1", "k") != record_key("t2", "k")
    assert record_key("t1", "any key/with.dots") .count(".") == 2


def test_fanned_out_records_count_one_request():
    def rec(rid: str, **kw) -> CompletionRecord:
        return CompletionRecord(rid, "t", "m", "1", "ok", "stop", 3, 2, {}, **kw)
    assert is_primary(rec("abc")) and is_primary(rec("abc-0", choice_index=0))
    assert not is_primary(rec("abc-3", choice_index=3))


def test_tenants_show_prints_no_hash():
    from control.ops.tenants_cli import _summary

    t = Tenant.from_record("acme", {"keys": {"k1": {"hash": "sha256:aa", "nats_hash": "$2b$10$xyz", "prefix": "sk-as-AbCd",
                                                    "created": 1.0, "revoked": None}}})
    assert _summary(t)["keys"] == {"k1": {"prefix": "sk-as-AbCd", "created": 1.0, "revoked": None}}
