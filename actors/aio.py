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


async def cancel_tasks(tasks, timeout_s: float = 5.0) -> None:
    """Cancel ``tasks`` (an iterable of asyncio tasks, None entries skipped) and wait up to ``timeout_s``
    seconds for them to end.

    Their own exceptions (CancelledError included) are not re-raised: they are ending on request. A cancel of
    the caller itself still propagates (``asyncio.wait`` raises it), so a shutdown path that is cancelled
    stops at once instead of swallowing its own cancellation (anyio's rule). Tasks still running after the
    deadline are left cancelled; their names are not needed by any caller.
    """
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    if live:
        await asyncio.wait(live, timeout=timeout_s)

