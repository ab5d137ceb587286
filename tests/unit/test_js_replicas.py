"""JetStream replicas setting (bus/streams.py ``check_replicas``, bus/jetstream.py ``replicas_from_env``):
``ACTORSERVE_JS_REPLICAS`` (1..5, default 1) is what every stream, KV bucket and object store is created
with; the cluster test (tests/cluster) runs with 3. Pure: no server."""

from __future__ import annotations

import pytest

from bus import streams
from bus.jetstream import JetStream, replicas_from_env


class _FakeNc:
    def jetstream(self, timeout: float):
        return object()


def test_default_is_one(monkeypatch):
    monkeypatch.delenv(streams.REPLICAS_ENV, raising=False)
    assert replicas_from_env() == 1
    assert JetStream(_FakeNc()).replicas == 1


def test_env_and_argument(monkeypatch):
    monkeypatch.setenv(streams.REPLICAS_ENV, " 3 ")
    assert JetStream(_FakeNc()).replicas == 3
    assert JetStream(_FakeNc(), replicas=5).replicas == 5  # the argument wins


@pytest.mark.parametrize("bad", ["0", "6", "three", "-1", "1.5"])
def test_bad_values_name_the_variable(monkeypatch, bad):
    monkeypatch.setenv(streams.REPLICAS_ENV, bad)
    with pytest.raises(ValueError, match=streams.REPLICAS_ENV):
        replicas_from_env()


def test_bad_argument_names_it():
    with pytest.raises(ValueError, match="replicas"):
        JetStream(_FakeNc(), replicas=0)
    with pytest.raises(ValueError):
        streams.check_replicas(True)
