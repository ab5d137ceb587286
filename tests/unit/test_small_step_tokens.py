"""``--small-step-tokens`` (decision 0051): a one-version worker runs one-token steps on one thread when asked; a
multi-version host never switches (its versions' engine threads share the process-wide thread count)."""

from __future__ import annotations

import argparse

from actors.worker.actor import add_arguments
from actors.worker.engine_build import small_step_tokens


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--model", "tiny@1", *argv])


def test_a_worker_switches_one_token_steps_when_asked_and_a_host_does_not():
    assert small_step_tokens(_args()) == 1  # the default since decision 0051's second measurement
    assert small_step_tokens(_args("--small-step-tokens", "0")) == 0
    assert small_step_tokens(_args("--small-step-tokens", "1")) == 1
    assert small_step_tokens(_args("--small-step-tokens", "8")) == 8
    assert small_step_tokens(_args("--host")) == 0
    assert small_step_tokens(_args("--host", "--small-step-tokens", "4")) == 0
