"""Messages between schedulers and multi-version worker hosts (actors/worker/host.py,
actors/scheduler/host_ask.py): frozen dataclasses with orjson encode/decode (``bus.messages.Message``)."""

from __future__ import annotations

from dataclasses import dataclass

from bus.messages import Message


@dataclass(frozen=True)
class HostLoad(Message):
    """A scheduler asks a multi-version worker host to make ``name@version`` resident (request-reply on
    ``as.int.host.<host_id>.load``; actors/worker/host.py). ``queue_len``: requests of the version waiting at
    the scheduler (the host's residency policy counts them as demand)."""

    name: str
    version: str
    queue_len: int = 1

    def __post_init__(self) -> None:
        if not self.name or not self.version:
            raise ValueError("HostLoad: name and version are required")
        if isinstance(self.queue_len, bool) or not isinstance(self.queue_len, int) or self.queue_len < 0:
            raise ValueError("HostLoad: queue_len must be an integer >= 0")


@dataclass(frozen=True)
class HostLoadAck(Message):
    """A host's answer to HostLoad: ``accepted`` (it is resident, loading, or will load when room frees),
    ``reason`` (why not, or its residency state), ``free_bytes`` (bytes of its budget not held now)."""

    accepted: bool
    reason: str = ""
    free_bytes: int = 0
