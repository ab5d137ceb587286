"""Helpers shared by the end-to-end tests: a tiny-model deployment and a worker-statistics probe."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Iterator

from bus import subjects
from bus.messages import WorkerStats
from bus.nats_bus import NatsBus


@contextlib.contextmanager
def tiny_deployment(state_dir, tiny_gguf: str, actor_args: dict, ready_s: float = 120, **kwargs) -> Iterator:
    """A Supervisor stack serving the tiny model as ``tiny`` (no restarts); stopped on exit. ``kwargs`` go to
    the Supervisor (e.g. ``env``)."""
    from control.ops.supervisor import Supervisor
    from control.ops.stack_config import StackConfig

    sup = Supervisor(StackConfig(state_dir, port=0, supervise=False, model_file=tiny_gguf, model_name="tiny",
                                 actor_args=actor_args, **kwargs))
    sup.start()
    try:
        sup.wait_ready(timeout=ready_s)
        yield sup
    finally:
        sup.stop()


async def latest_worker_stats(nats_url: str, worker_id: str = "worker-0", timeout: float = 10.0) -> WorkerStats:
    """The next statistics message of ``worker_id`` (published about once a second)."""
    bus = await NatsBus.connect(nats_url, name="test-stats")
    got: list[WorkerStats] = []
    ev = asyncio.Event()

    async def on(msg):
        got.append(WorkerStats.decode(msg.data))
        ev.set()
    sub = await bus.subscribe(subjects.stats(worker_id), on)
    try:
        async with asyncio.timeout(timeout):
            await ev.wait()
    finally:
        await sub.unsubscribe()
        await bus.close()
    return got[-1]


# ---- bring-your-own-model tests (test_byom_live.py, test_byom_windows_live.py, test_moe_live.py) ----------------

# ChatML, as Qwen writes it (the tiny vocabularies have no special tokens for it: they are plain text there)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_long(table: dict, build, name: str, tmp, seed: int, variant=None, context: int = 4096) -> dict:
    """``build(name + "-long", tmp, seed)`` of ``variant`` (default ``table[name]``; a tests/family_models.py
    Variant) with ``max_position_embeddings`` = ``context``, added to ``table`` (a variant table ``build`` reads)
    for the build and removed again. Returns build's dict ({"model", "hf", "gguf"})."""
    import dataclasses

    variant = variant or table[name]
    table[f"{name}-long"] = dataclasses.replace(variant, config={**variant.config, "max_position_embeddings": context})
    try:
        return build(f"{name}-long", tmp, seed=seed)
    finally:
        del table[f"{name}-long"]


def register_chatml(sup, tmp, name: str, artifact: str) -> None:
    """``actorserve models register NAME 1 --artifact ARTIFACT`` with the CHATML template and hermes tool calls;
    asserts the command succeeded."""
    from tests.e2e.test_registry_live import cli

    (tmp / "chatml.jinja").write_text(CHATML)
    p = cli(sup, "models", "register", name, "1", "--artifact", artifact, "--chat-template",
            f"@{tmp / 'chatml.jinja'}", "--option", 'tool_call_format="hermes"')
    assert p.returncode == 0, p.stderr


def wait_until(cond, timeout_s: float = 5.0, what: str = "the condition") -> None:
    """Poll ``cond()`` every 50 ms until true; AssertionError naming ``what`` after ``timeout_s`` seconds."""
    import time

    t_end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < t_end, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.05)


def until_served(client, model: str, timeout_s: float = 180.0) -> None:
    """Retries a one-token chat to ``model`` (``openai`` client) until it answers; fails after ``timeout_s``."""
    import time

    import openai

    t_end = time.monotonic() + timeout_s
    while True:
        try:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
            return
        except (openai.APIStatusError, openai.APIConnectionError) as e:
            assert time.monotonic() < t_end, f"{model} not served after {timeout_s} s: {e}"
            time.sleep(1.0)


def register_all(sup, tmp, models: dict[str, str]):
    """Register each ``{name: artifact}`` (:func:`register_chatml`); returns an ``openai`` client of the
    deployment's gateway (timeout 60 s, no retries)."""
    import openai

    for name, artifact in models.items():
        register_chatml(sup, tmp, name, artifact)
    return openai.OpenAI(base_url=sup.http_url + "/v1", api_key=sup.dev_api_key, timeout=60, max_retries=0)


def chat_full_and_streamed(client, model: str, msgs: list[dict], max_tokens: int):
    """A greedy chat of ``max_tokens`` tokens, not streamed then streamed: asserts it stopped or reached the length
    with at least one token, and that the streamed text equals the other's. Returns the non-streamed response."""
    full = client.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, temperature=0)
    assert full.choices[0].finish_reason in ("stop", "length"), full.choices[0]
    assert full.usage.completion_tokens >= 1, full.usage
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=msgs, max_tokens=max_tokens, temperature=0, stream=True) if c.choices)
    assert text == (full.choices[0].message.content or "")  # streamed equals non-streamed
    return full
