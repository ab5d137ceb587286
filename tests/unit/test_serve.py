"""actors/serve.py: the skeleton every actor's main runs (build, wait until cancelled, bounded shielded
closers in reverse order, cancellation propagated). Pure: the context's registry and bus are fakes."""

from __future__ import annotations

import argparse
import asyncio
import logging

import pytest

from actors import serve as serve_mod
from actors.serve import ActorContext, serve


@pytest.fixture
def contexts(monkeypatch):
    """Contexts handed out by serve (no etcd: a fake registry whose close is recorded)."""
    made: list[ActorContext] = []

    async def fake_open(args, name):
        ctx = ActorContext(args, name, "nats://unused")
        ctx.registry = object()
        ctx.on_stop(lambda: _note(ctx, "registry"), what="registry")
        made.append(ctx)
        return ctx

    monkeypatch.setattr(serve_mod, "open_context", fake_open)
    return made


async def _note(ctx: ActorContext, what: str, delay: float = 0.0) -> None:
    await asyncio.sleep(delay)
    ctx.args.closed.append(what)


def _args() -> argparse.Namespace:
    return argparse.Namespace(closed=[])


async def _started(task: asyncio.Task, args: argparse.Namespace) -> None:
    for _ in range(100):
        if getattr(args, "built", False):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("build did not run")


async def test_closers_run_last_first_and_the_cancellation_propagates(contexts):
    args = _args()

    async def build(ctx):
        ctx.on_stop(lambda: _note(ctx, "service"), what="service")
        ctx.on_stop(lambda: _note(ctx, "listener", delay=0.05), what="listener")
        args.built = True

    task = asyncio.create_task(serve(args, "t", build))
    await _started(task, args)
    await asyncio.sleep(0.02)
    assert not task.done() and args.closed == []  # serving until cancelled
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert args.closed == ["listener", "service", "registry"]


async def test_a_slow_or_failing_closer_is_bounded_and_the_rest_still_run(contexts, caplog):
    args = _args()

    async def boom():
        raise RuntimeError("closer broke")

    async def build(ctx):
        ctx.on_stop(lambda: _note(ctx, "first"))
        ctx.on_stop(lambda: _note(ctx, "never", delay=5.0), timeout_s=0.05, what="slow part")
        ctx.on_stop(boom, what="broken part")
        args.built = True

    task = asyncio.create_task(serve(args, "t", build))
    await _started(task, args)
    caplog.set_level(logging.WARNING, logger="actorserve.serve")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert args.closed == ["first", "registry"]
    text = caplog.text
    assert "stopping broken part failed" in text and "closer broke" in text
    assert "stopping slow part took over 0.05 s" in text
    # before it timed out, where it waited was logged (the closer's own await chain, innermost last)
    assert "stopping slow part still runs; the tasks wait at:" in text and "_note -> " in text


async def test_cancel_tasks_cancels_again_a_task_that_lost_its_cancel():
    from actors.aio import cancel_tasks

    seen = []

    async def loses_first_cancel():  # what a library's wait_for does when the cancel meets a result
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append("lost")
        await asyncio.sleep(10)

    task = asyncio.create_task(loses_first_cancel())
    await asyncio.sleep(0)
    t0 = asyncio.get_running_loop().time()
    await cancel_tasks([task, None], timeout_s=3.0, recancel_s=0.05)
    assert task.cancelled() and seen == ["lost"]
    assert asyncio.get_running_loop().time() - t0 < 1.0


async def test_shutdown_is_shielded_from_a_second_cancel(contexts):
    args = _args()

    async def build(ctx):
        ctx.on_stop(lambda: _note(ctx, "drain", delay=0.2), timeout_s=2.0, what="drain")
        args.built = True

    task = asyncio.create_task(serve(args, "t", build))
    await _started(task, args)
    task.cancel()
    await asyncio.sleep(0.05)  # draining now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task  # the second cancel is not swallowed ...
    assert args.closed == []
    await asyncio.sleep(0.4)
    assert args.closed == ["drain", "registry"]  # ... and the drain was not cut short


async def test_build_failure_closes_what_was_started_and_propagates(contexts):
    args = _args()

    async def build(ctx):
        ctx.on_stop(lambda: _note(ctx, "half-started"))
        raise SystemExit("model version m@1 is not registered")

    with pytest.raises(SystemExit, match="not registered"):
        await serve(args, "t", build)
    assert args.closed == ["half-started", "registry"]


async def test_a_cancelled_closing_task_stops_closing():
    ctx = ActorContext(_args(), "t", "nats://unused")
    ctx.on_stop(lambda: _note(ctx, "later"))
    ctx.on_stop(lambda: _note(ctx, "stuck", delay=5.0), timeout_s=10.0)
    closing = asyncio.create_task(ctx.aclose())
    await asyncio.sleep(0.02)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert ctx.args.closed == []


def test_on_stop_rejects_a_non_positive_timeout():
    ctx = ActorContext(_args(), "t", "nats://unused")
    with pytest.raises(ValueError, match="timeout_s"):
        ctx.on_stop(lambda: _note(ctx, "x"), timeout_s=0)
