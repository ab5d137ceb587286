"""Wire messages: frozen dataclasses with an orjson codec.

Every request-carrying message has, from the start: request id, tenant, model reference, priority,
absolute deadline (Unix epoch seconds) and timing marks (stage name -> Unix epoch seconds). Decoding
ignores unknown fields so a newer sender can talk to an older receiver (rolling upgrades).

Flow (ARCHITECTURE.md "Request flow"): gateway --ApiRequest--> validator --GenerateRequest-->
scheduler --GenerateRequest--> worker --Chunk*--> the request's reply subject. Any actor that ends a
request early (bad input, overload, lost worker) publishes a final error Chunk to the reply subject.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import orjson

T = TypeVar("T", bound="Message")

PRIORITIES = ("interactive", "batch")  # priority classes, highest first


class Message:
    """Mixin: orjson encode/decode for frozen dataclasses."""

    _fields: ClassVar[frozenset[str] | None] = None

    def encode(self) -> bytes:
        """Serialize to JSON bytes (orjson; tuples become lists)."""
        return orjson.dumps(self)

    @classmethod
    def decode(cls: type[T], data: bytes) -> T:
        """Parse JSON bytes; unknown keys are ignored. Raises ValueError on malformed input."""
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{cls.__name__}: invalid JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise ValueError(f"{cls.__name__}: expected a JSON object")
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls: type[T], obj: dict[str, Any]) -> T:
        """Build from a dict, dropping unknown keys. Raises ValueError if required fields are missing."""
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        try:
            return cls(**{k: v for k, v in obj.items() if k in names})
        except TypeError as exc:
            raise ValueError(f"{cls.__name__}: {exc}") from exc


@dataclass(frozen=True)
class ApiRequest(Message):
    """Gateway -> validator: an authenticated, routed public API request (body not yet validated)."""

    request_id: str  # platform request id (also the X-Request-Id echoed to the client)
    tenant: str  # tenant id
    model: str  # requested model reference as sent by the client ("name", "name@version")
    name: str  # resolved model name
    version: str  # resolved model version
    endpoint: str  # "chat" | "completions"
    body: dict[str, Any]  # the client's JSON body
    reply: str  # subject the response chunks go to
    priority: str = "interactive"  # priority class
    deadline: float = 0.0  # absolute deadline, Unix epoch seconds
    marks: dict[str, float] = field(default_factory=dict)  # timing marks, stage -> epoch s


@dataclass(frozen=True)
class GenerateRequest(Message):
    """Validator -> scheduler -> worker: a tokenized, validated generation request."""

    request_id: str
    tenant: str
    name: str  # model name
    version: str  # model version
    reply: str  # subject the worker streams chunks to
    prompt_token_ids: tuple[int, ...]  # tokenized prompt
    sampling: dict[str, Any]  # SamplingParams fields (temperature, top_p, top_k, seed, max_tokens, stop, ...)
    priority: str = "interactive"
    deadline: float = 0.0  # absolute deadline, Unix epoch seconds
    marks: dict[str, float] = field(default_factory=dict)
    adapter: str | None = None  # LoRA adapter (later issue)
    attempt: int = 0  # dispatch attempt (0 = first); bumped on re-dispatch after a worker loss
    echo_text: str = ""  # completions `echo`: prompt text the worker prepends to the first chunk's text

    @property
    def model_ref(self) -> str:
        """``name@version`` of the version serving this request."""
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class Chunk(Message):
    """Any actor -> the request's reply subject: tokens of one engine step, or the final/error record.

    ``seq`` numbers chunks from 0 per request; the gateway detects gaps. The last chunk has
    ``final=True`` and carries ``finish_reason`` and ``usage`` (or ``error``) and ``timing``.
    """

    request_id: str
    seq: int  # 0, 1, 2, ... per request
    text: str = ""  # text delta (valid UTF-8)
    token_ids: tuple[int, ...] = ()  # token ids produced in this step
    final: bool = False  # last chunk of the request
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the final chunk
    usage: dict[str, int] | None = None  # prompt_tokens, completion_tokens, total_tokens
    timing: dict[str, float] | None = None  # timing breakdown in ms (keys of ARCHITECTURE.md)
    error: dict[str, Any] | None = None  # {status, message, type, param, code, retryable, retry_after}
    model: str = ""  # name@version that served it
    worker_id: str = ""  # worker that produced it ("" for early errors)
    # per token of this chunk when logprobs were requested (OpenAI chat shape):
    # [{"token": str, "bytes": [int], "logprob": float, "top_logprobs": [{"token", "bytes", "logprob"}]}]
    logprobs: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Cancel(Message):
    """Cancel one request (``as.int.cancel.<id>`` or ``as.api.v1.cancel``)."""

    request_id: str
    reason: str = "client"  # "client" | "deadline" | "disconnect"
    tenant: str = ""  # tenant of the caller (public API: must match the request's tenant)


@dataclass(frozen=True)
class Dispatch(Message):
    """Scheduler -> worker envelope: the request plus the scheduler's identity.

    ``preempt``: id of a request running on that worker that this one displaces (fair-share preemption,
    docs/decisions/0018-fair-share-preemption.md): the worker may take the request with no free slot by
    recompute-preempting that one; "" = an ordinary dispatch within the worker's credits."""

    request: GenerateRequest
    scheduler_id: str = ""
    preempt: str = ""

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> "Dispatch":
        """Decode, rebuilding the nested GenerateRequest."""
        req = obj.get("request")
        if not isinstance(req, dict):
            raise ValueError("Dispatch: 'request' must be an object")
        return cls(request=GenerateRequest.from_dict(req), scheduler_id=str(obj.get("scheduler_id", "")),
                   preempt=str(obj.get("preempt") or ""))


@dataclass(frozen=True)
class DispatchAck(Message):
    """Worker -> scheduler reply to a Dispatch: accepted, or refused (no credit, draining)."""

    accepted: bool
    reason: str = ""


@dataclass(frozen=True)
class Credits(Message):
    """Worker heartbeat (~4 Hz) on ``as.int.credits.<name>.<version>.<worker_id>``."""

    worker_id: str
    name: str
    version: str
    free_blocks: int  # free KV cache blocks
    total_blocks: int  # KV cache blocks in all
    free_slots: int  # free sequence slots (max_num_seqs - running - waiting)
    total_slots: int  # max_num_seqs
    block_size: int  # tokens per KV block
    num_running: int = 0
    num_waiting: int = 0
    draining: bool = False  # worker accepts no new work
    ts: float = 0.0  # send time, Unix epoch s


@dataclass(frozen=True)
class WorkerStats(Message):
    """Worker statistics on ``as.int.stats.<worker_id>``."""

    worker_id: str
    name: str
    version: str
    num_steps: int  # forward passes run
    num_generated_tokens: int  # tokens sampled, all requests
    num_prompt_tokens: int  # prompt tokens prefilled
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    max_batch_size_seen: int
    num_finished: int = 0  # requests finished (any reason)
    num_aborted: int = 0  # requests cancelled
    ts: float = 0.0
    max_cancel_steps: int = 0  # most engine steps between a cancel's arrival and its request's end
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefix_cache_query_tokens: int = 0  # prompt tokens looked up in the prefix cache


@dataclass(frozen=True)
class CompletionRecord(Message):
    """One record per finished request on ``as.int.done.<name>.<version>``."""

    request_id: str
    tenant: str
    name: str
    version: str
    status: str  # "ok" | "error" | "cancelled"
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    timing: dict[str, float]  # ms, keys of ARCHITECTURE.md
    priority: str = "interactive"
    error_code: str | None = None
    worker_id: str = ""
    ts: float = 0.0


def error_dict(status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None, retryable: bool = False, retry_after: float | None = None) -> dict:
    """Build the ``Chunk.error`` payload: HTTP status plus OpenAI error fields and retry hints."""
    return {"status": status, "message": message, "type": type_, "param": param, "code": code,
            "retryable": retryable, "retry_after": retry_after}
