"""Small asyncio helpers shared by actors."""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; True if it was set.

    Uses ``asyncio.timeout`` rather than ``asyncio.wait_for``: on Python 3.11 ``wait_for`` can swallow
    a cancellation that arrives just as the event is set (CPython gh-86296), which would make a
    cancelled loop run on forever.
    """
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
        return True
    except TimeoutError:
        return False


async def cancel_tasks(tasks, timeout_s: float = 5.0, recancel_s: float = 1.0) -> None:
    """Cancel ``tasks`` (an iterable of asyncio tasks, None entries skipped) and wait up to ``timeout_s``
    seconds for them to end; a task still running ``recancel_s`` seconds after a cancel is cancelled again.

    The repeat is there because a library can lose a cancel: on Python 3.11 ``asyncio.wait_for`` returns the
    result instead of raising when the cancel arrives as the awaited call completes (CPython gh-86296), and
    nats-py's ``next_msg`` (under every JetStream ``fetch``) waits with it. A fetch loop that lost its cancel
    ran on, and the gateway's stop hung until SIGKILL 15 s later (3 times in one ``make test``). One second
    leaves a task's own bounded cleanup (an etcd watch cancel, a last publish) time to finish first.

    Their own exceptions (CancelledError included) are not re-raised: they are ending on request. A cancel of
    the caller itself still propagates (``asyncio.wait`` raises it), so a shutdown path that is cancelled
    stops at once instead of swallowing its own cancellation (anyio's rule). Tasks still running after the
    deadline are left cancelled; their names are not needed by any caller.
    """
    live = [t for t in tasks if t is not None]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while live:
        for t in live:
            t.cancel()
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return
        _, pending = await asyncio.wait(live, timeout=min(recancel_s, left))
        live = list(pending)

