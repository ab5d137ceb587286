"""The state of a sequence that moves between workers (preemption notice, drain): pure, no torch, no nats.

A worker that gives up a running sequence sends it to its scheduler as ``GenerateRequest(resume=
ResumeState.to_json())``; the worker that takes it over recomputes the KV cache from prompt +
``output_ids`` (one prefill) and goes on as if the sequence had never moved:

* ``output_ids``: every token generated so far (all of them already streamed to the client). They
  feed max_tokens, penalties, the grammar matcher and the detokenizer / stop-string state, which the
  receiver re-derives by replaying them (``detokenizer.replay``), never re-sending their text;
* ``seq``: the next chunk sequence number on the request's reply subject (the gateway sees one
  gap-free sequence; only the worker id changes);
* ``rng_state``: the per-request ``torch.Generator`` state (``Generator.get_state()`` bytes, 5056 for
  the CPU Mersenne Twister), so a seeded sampled stream draws the same numbers it would have drawn;
* ``t_in`` / ``t_first``: when the first worker accepted it and streamed its first token (epoch s),
  so the final timing breakdown stays the request's own; ``echo_pending``: completions ``echo`` not sent
  yet; ``from_worker``: who gave it up (the scheduler sends it elsewhere); ``migrations``: moves so far;
  ``t_handoff``: when it left (epoch s), for the hand-over gap.

Wire form (``to_json``): a JSON object, the RNG state base64. ``from_json`` raises ValueError on a
malformed payload. Version 1.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

VERSION = 1
MAX_MIGRATIONS = 8  # a sequence moved this often is not moved again (a notice storm must not ping-pong it)


@dataclass(frozen=True)
class ResumeState:
    """What the receiving worker needs to continue a sequence (see module docstring). ValueError on bad values."""

    from_worker: str
    output_ids: tuple[int, ...] = ()
    seq: int = 0  # next chunk seq
    rng_state: bytes | None = None  # torch.Generator.get_state() bytes; None: a fresh generator from the seed
    t_in: float = 0.0  # epoch s
    t_first: float = 0.0  # epoch s; 0 before the first token
    echo_pending: bool = True
    migrations: int = 1
    t_handoff: float = 0.0  # epoch s

    def __post_init__(self) -> None:
        if not self.from_worker:
            raise ValueError("resume: from_worker is required")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.output_ids):
            raise ValueError("resume: output_ids must be non-negative token ids")
        if self.seq < 0 or self.migrations < 1:
            raise ValueError("resume: seq must be >= 0 and migrations >= 1")
        if self.rng_state is not None and not isinstance(self.rng_state, bytes):
            raise ValueError("resume: rng_state must be bytes")

    def to_json(self) -> dict[str, Any]:
        """The ``GenerateRequest.resume`` object."""
        return {"v": VERSION, "from_worker": self.from_worker, "output_ids": list(self.output_ids),
                "seq": self.seq, "rng": None if self.rng_state is None else base64.b64encode(self.rng_state).decode(),
                "t_in": self.t_in, "t_first": self.t_first, "echo_pending": self.echo_pending,
                "migrations": self.migrations, "t_handoff": self.t_handoff}

    @classmethod
    def from_json(cls, obj: Any) -> "ResumeState":
        """Parse a ``GenerateRequest.resume`` object; ValueError when it is not one (or of another version)."""
        if not isinstance(obj, dict) or obj.get("v") != VERSION:
            raise ValueError(f"resume: expected an object of version {VERSION}")
        try:
            rng = obj.get("rng")
            return cls(str(obj["from_worker"]), tuple(obj.get("output_ids") or ()), int(obj.get("seq", 0)),
                       None if rng is None else base64.b64decode(rng, validate=True),
                       float(obj.get("t_in", 0.0)), float(obj.get("t_first", 0.0)),
                       bool(obj.get("echo_pending", True)), int(obj.get("migrations", 1)),
                       float(obj.get("t_handoff", 0.0)))
        except (KeyError, TypeError, binascii.Error) as exc:
            raise ValueError(f"resume: malformed ({exc})") from exc


def resume_of(resume: Any) -> ResumeState | None:
    """``GenerateRequest.resume`` -> ResumeState, None when the request is no migrated sequence."""
    return None if resume is None else ResumeState.from_json(resume)
