"""Wire messages: frozen dataclasses with an orjson codec.

Every request-carrying message has, from the start: request id, tenant, model reference, priority,
absolute deadline (Unix epoch seconds) and timing marks (stage name -> Unix epoch seconds). Decoding
ignores unknown fields so a newer sender can talk to an older receiver (rolling upgrades).

Flow (docs/architecture.md "Request flow"): gateway --ApiRequest--> validator --GenerateRequest-->
scheduler --GenerateRequest--> worker --Chunk*--> the request's reply subject. Any actor that ends a
request early (bad input, overload, lost worker) publishes a final error Chunk to the reply subject; its
``error`` is a ``bus.errors.ServeError`` on the wire (``ServeError.to_wire()``, read back by ``Chunk.failure``).

Every request-reply hop answers with a typed message: ``HopAck`` (validator and scheduler hand-offs, a
worker's migration hand-over), ``DispatchAck`` (worker), ``ValidatorPong`` to a ``ValidatorPing`` and
``ProbeAnswer`` to a worker's ``ReceiverProbe``; each decodes the older untyped bytes of the same meaning.

``SamplingParams`` (carried in ``GenerateRequest.sampling``) is the one definition of the sampling fields:
the validator builds it, the scheduler reads ``max_tokens`` for its cost estimate, and the worker hands it to
the engine as is. A request fanned out into several choices (``n`` > 1, a list of prompts) carries its
choice's index in ``choice_index`` (GenerateRequest, Chunk, CompletionRecord), so no consumer parses ids.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

import orjson

from bus.errors import ServeError
from control.policy.numbers import is_number

T = TypeVar("T", bound="Message")

PRIORITIES = ("interactive", "batch")  # priority classes, highest first
TOOL_CALL_FORMATS = ("hermes",)  # manifest tool_call_format / GenerateRequest.tool_parser (text/tool_calls.py)
REASONING_FORMATS = ("think_tags",)  # manifest reasoning_format / GenerateRequest.reasoning_parser (text/reasoning.py)
REASONING_STATES = ("start", "reasoning", "answer")  # where an output starts (text/reasoning.py prompt_state)


_FIELD_NAMES: dict[type, frozenset[str]] = {}  # a message class -> the names of its fields (Message.from_dict)


class Message:
    """Mixin: orjson encode/decode for frozen dataclasses."""

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
        names = _FIELD_NAMES.get(cls)
        if names is None:  # once per class: ``dataclasses.fields`` on every decode was ~10 % of a gateway's CPU
            names = _FIELD_NAMES[cls] = frozenset(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
        try:
            return cls(**{k: v for k, v in obj.items() if k in names})
        except TypeError as exc:
            raise ValueError(f"{cls.__name__}: {exc}") from exc


# --------------------------------------------------------------------------- sampling parameters
def _number(lo: float, hi: float, lo_open: bool = False) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        ok = is_number(v)
        if not ok or not ((lo < v) if lo_open else (lo <= v)) or v > hi:
            raise ValueError(f"a number in {'(' if lo_open else '['}{lo}, {hi}]")
        return float(v)
    return check


def _integer(lo: int, hi: int | None = None, optional: bool = False) -> Callable[[Any], int | None]:
    def check(v: Any) -> int | None:
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise ValueError(f"{'null or ' if optional else ''}an integer {span}")
        return v
    return check


def _sequence(item: type, lo: int | None = None) -> Callable[[Any], tuple]:
    def check(v: Any) -> tuple:
        items = (v,) if isinstance(v, str) and item is str else v
        if not isinstance(items, (list, tuple)) or not all(
                isinstance(x, item) and not isinstance(x, bool) and (lo is None or x >= lo) for x in items):
            raise ValueError("a string or a list of strings" if item is str else "a list of non-negative integers")
        return tuple(items)
    return check


def _boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("a boolean")
    return v


def _logit_bias(v: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI ``logit_bias``: a mapping token id -> bias (JSON object keys are strings) or (id, bias) pairs;
    ids >= 0, biases in [-100, 100], at most ``MAX_LOGIT_BIAS`` entries. Returns pairs sorted by id."""
    items = v.items() if isinstance(v, Mapping) else v
    if not isinstance(items, (list, tuple, type({}.items()))):
        raise ValueError("an object mapping token ids to biases in [-100, 100]")
    out: dict[int, float] = {}
    for pair in items:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError("an object mapping token ids to biases in [-100, 100]")
        out[_token_id(pair[0])] = _number(-100.0, 100.0)(pair[1])
    if len(out) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
    return tuple(sorted(out.items()))


def _token_id(k: Any) -> int:
    if isinstance(k, str) and k.isdigit():
        k = int(k)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError("an object whose keys are token ids (non-negative integers)")
    return k


def _optional_text(v: Any) -> str | None:
    if v is not None and (not isinstance(v, str) or not v):
        raise ValueError("null or a non-empty string")
    return v


def _param(default: Any, check: Callable[[Any], Any], manifest: bool = False) -> Any:
    """A SamplingParams field: its default, its check, and whether a model manifest may default it."""
    return field(default=default, metadata={"check": check, "manifest": manifest})


MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries


@dataclass(frozen=True)
class SamplingParams(Message):
    """Per-request sampling and stopping parameters: validator -> scheduler -> worker -> engine.

    The one definition of these fields (the engine's ``SamplingParams`` is this class). Validated at
    construction: every bad value raises ValueError naming the field; lists become tuples, numbers
    of float fields become floats. Ranges are OpenAI's (temperature [0, 2], penalties [-2, 2], 64-bit seeds).
    Fields marked ``manifest`` may be defaulted by a model manifest (``MANIFEST_DEFAULTABLE``).
    """

    temperature: float = _param(1.0, _number(0.0, 2.0), manifest=True)  # 0 means greedy (argmax)
    top_p: float = _param(1.0, _number(0.0, 1.0, lo_open=True), manifest=True)  # nucleus mass in (0, 1]
    top_k: int = _param(0, _integer(0), manifest=True)  # 0 disables top-k
    seed: int | None = _param(None, _integer(-(2**63), 2**64 - 1, optional=True), manifest=True)  # None: random
    max_tokens: int = _param(16, _integer(1), manifest=True)  # generated-token cap (tokens)
    stop_token_ids: tuple[int, ...] = _param((), _sequence(int, 0))  # stop ids (EOS / end-of-turn included)
    stop: tuple[str, ...] = _param((), _sequence(str), manifest=True)  # stop strings, excluded from output
    ignore_eos: bool = _param(False, _boolean)  # keep generating past EOS (benchmarks)
    logprobs: int | None = _param(None, _integer(0, 20, optional=True))  # None: off; k: sampled + top k
    frequency_penalty: float = _param(0.0, _number(-2.0, 2.0), manifest=True)  # logit -= count * penalty
    presence_penalty: float = _param(0.0, _number(-2.0, 2.0), manifest=True)  # logit -= (count > 0) * penalty
    # (token id, bias) sorted by id, biases in [-100, 100] added to the raw logits (OpenAI semantics)
    logit_bias: tuple[tuple[int, float], ...] = _param((), _logit_bias)
    min_p: float = _param(0.0, _number(0.0, 1.0), manifest=True)  # drop tokens with p < min_p * max p; 0 = off
    # CTRL (Keskar et al. 2019): logits of prompt + generated tokens divided (> 0) or multiplied (< 0) by it
    repetition_penalty: float = _param(1.0, _number(0.0, 10.0, lo_open=True), manifest=True)  # 1 = off
    # llguidance grammar the output must match (its JSON TopLevelGrammar text, built by the validator from
    # response_format / structured_outputs / guided_* / tools); None = unconstrained
    grammar: str | None = _param(None, _optional_text)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, check_sampling_field(f.name, getattr(self, f.name)))

    def seeded(self, offset: int) -> "SamplingParams":
        """A copy whose seed is ``seed + offset`` wrapped into 64 bits (choice ``offset`` of ``n``); no seed: self."""
        if self.seed is None or not offset:
            return self
        seed = self.seed + offset
        return dataclasses.replace(self, seed=seed - 2**64 if seed >= 2**64 else seed)


_SAMPLING_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
MANIFEST_DEFAULTABLE = tuple(n for n, f in _SAMPLING_FIELDS.items() if f.metadata["manifest"])


def check_sampling_field(name: str, value: Any, label: str | None = None) -> Any:
    """Check and normalize one SamplingParams field value. ValueError naming ``label`` (default ``name``)."""
    f = _SAMPLING_FIELDS.get(name)
    if f is None:
        raise ValueError(f"{label or name} is not a sampling parameter")
    try:
        return f.metadata["check"](value)
    except ValueError as exc:
        shown = repr(value)
        raise ValueError(f"{label or name} must be {exc}, got {shown if len(shown) <= 80 else shown[:77] + '...'}") from None


def sampling_defaults(defaults: Mapping[str, Any], label: str = "defaults") -> dict[str, Any]:
    """Check a model manifest's sampling ``defaults``; return them normalized (``stop`` a tuple).

    Raises ValueError naming ``<label>.<key>`` for a key that is no manifest-defaultable parameter
    (``MANIFEST_DEFAULTABLE``), or a bad value.
    """
    if not isinstance(defaults, Mapping):
        raise ValueError(f"{label} must be an object")
    out = {}
    for k, v in defaults.items():
        if k not in MANIFEST_DEFAULTABLE:
            raise ValueError(f"{label}.{k} is not a known sampling parameter "
                             f"(known: {', '.join(MANIFEST_DEFAULTABLE)})")
        out[k] = check_sampling_field(k, v, f"{label}.{k}")
    return out


# --------------------------------------------------------------------------- request-carrying messages
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
    adapter: str | None = None  # resolved LoRA adapter ("name:adapter" references; registry record checked)
    adapter_path: str = ""  # the adapter's PEFT directory from its registry record (never from the client)
    # subject the receiver takes step frames on (bus.subjects.frames; StepFrame): workers then put this request's
    # chunks into one message per step per receiver instead of one per chunk on ``reply``. "" = no frames (a
    # receiver that does not read them: every chunk goes to ``reply``, as before)
    frames: str = ""


@dataclass(frozen=True)
class GenerateRequest(Message):
    """Validator -> scheduler -> worker: a tokenized, validated generation request."""

    request_id: str
    tenant: str
    name: str  # model name
    version: str  # model version
    reply: str  # subject the worker streams chunks to
    prompt_token_ids: tuple[int, ...]  # tokenized prompt
    sampling: SamplingParams  # sampling and stopping parameters
    priority: str = "interactive"
    deadline: float = 0.0  # absolute deadline, Unix epoch seconds
    marks: dict[str, float] = field(default_factory=dict)
    adapter: str | None = None  # LoRA adapter name (resolved by the gateway; None = base model)
    adapter_path: str = ""  # its PEFT directory (registry record via the gateway): a worker that has not seen the
    # record yet registers the adapter from it (no race between the gateway's and the worker's registry reads)
    attempt: int = 0  # dispatch attempt (0 = first); bumped on re-dispatch after a worker loss
    echo_text: str = ""  # completions `echo`: prompt text the worker prepends to the first chunk's text
    choice_index: int = 0  # index of this choice in its API request's response (prompt_index * n + i)
    # tool calling (docs/tools.md): the parser the worker runs on the output (TOOL_CALL_FORMATS,
    # set by the validator from the manifest's tool_call_format when tools are offered); None = plain text
    tool_parser: str | None = None
    parallel_tool_calls: bool = True  # False: at most one call is parsed out of the output
    tool_calls_forced: bool = False  # the grammar forces well-formed calls: their arguments stream as written
    # reasoning output (docs/decisions/0044-reasoning-output.md): the parser that splits the thinking from the
    # answer (REASONING_FORMATS; None = none) and where the output starts (REASONING_STATES, from the prompt)
    reasoning_parser: str | None = None
    reasoning_state: str = "start"
    # a migrated sequence (preemption notice, drain): the state its previous worker handed over, as
    # actors/worker/migration_state.ResumeState.to_json() (tokens generated so far, next chunk seq, sampler RNG
    # state, ...); set only by workers, dispatched first to another worker (actors/scheduler/resume.py)
    resume: dict[str, Any] | None = None
    # set by the scheduler when it dispatches (never from a client): the prefix-cache salt (hex of 16 bytes,
    # actors/cache_salt.py) and the tenant's fair-share weight (the worker's KV share under contention)
    cache_salt: str = ""
    tenant_weight: float = 1.0
    frames: str = ""  # the receiver's step-frame subject (ApiRequest.frames; "" = every chunk on ``reply``)

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"GenerateRequest.sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if self.resume is not None and not isinstance(self.resume, dict):
            raise ValueError("GenerateRequest.resume must be an object or null")
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) not in (0, 32) or any(
                c not in "0123456789abcdef" for c in self.cache_salt):
            raise ValueError("GenerateRequest.cache_salt must be '' or 32 lowercase hex digits")
        if not is_number(self.tenant_weight) or not self.tenant_weight > 0:
            raise ValueError("GenerateRequest.tenant_weight must be a positive number")

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> "GenerateRequest":
        """Decode, rebuilding the nested SamplingParams (unknown keys of either are ignored)."""
        smp = obj.get("sampling")
        if not isinstance(smp, dict):
            raise ValueError("GenerateRequest: 'sampling' must be an object")
        return super().from_dict({**obj, "sampling": SamplingParams.from_dict(smp)})

    @property
    def model_ref(self) -> str:
        """``name@version`` of the version serving this request."""
        return f"{self.name}@{self.version}"


def choice_request_id(request_id: str, index: int) -> str:
    """The request id of choice ``index`` of a fanned-out API request ``request_id``: ``<request_id>-<index>``
    (the validator names the choices so; the gateway registers and cancels them by it). One definition; no
    consumer parses it back (chunks carry ``choice_index``)."""
    return f"{request_id}-{index}"


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
    finish_reason: str | None = None  # "stop" | "length" | "tool_calls" | "abort" on the final chunk
    usage: dict[str, int] | None = None  # prompt_tokens, completion_tokens, total_tokens
    timing: dict[str, float] | None = None  # timing breakdown in ms (keys: docs/architecture.md "Conventions")
    error: dict[str, Any] | None = None  # bus.errors.ServeError.to_wire(): {status, message, type, param, code, ...}
    model: str = ""  # name@version that served it
    worker_id: str = ""  # worker that produced it ("" for early errors)
    # per token of this chunk when logprobs were requested (OpenAI chat shape):
    # [{"token": str, "bytes": [int], "logprob": float, "top_logprobs": [{"token", "bytes", "logprob"}]}]
    logprobs: list[dict[str, Any]] | None = None
    choice_index: int = 0  # the request's GenerateRequest.choice_index (0 for an unsplit request)
    # OpenAI streaming tool-call deltas parsed out of the output by the worker (GenerateRequest.tool_parser):
    # {"index", "id", "type": "function", "function": {"name", "arguments": ""}} opens call ``index``, then
    # {"index", "function": {"arguments": <piece>}}; the call's text is not in ``text``
    tool_calls: tuple[dict[str, Any], ...] = ()
    reasoning: str = ""  # thinking text delta split out by GenerateRequest.reasoning_parser (not in ``text``)

    @property
    def failure(self) -> ServeError | None:
        """``error`` as a :class:`bus.errors.ServeError` (None: no error)."""
        return ServeError.from_wire(self.error) if self.error is not None else None


@dataclass(frozen=True)
class StepFrame(Message):
    """Worker -> one receiver's frame subject (bus.subjects.frames): every chunk of one engine step for the
    requests of that receiver (a gateway or the jobs frontend), in the order the worker produced them (issue
    [25], docs/decisions/0052-step-frames.md). One message per step per receiver instead of one per chunk;
    each chunk keeps its request id and seq, so order and gap detection are per request as before.

    Wire: ``{"chunks": [<Chunk>, ...]}``, each item exactly the JSON of :meth:`Chunk.encode` (so a worker
    joins chunks it already encoded, :meth:`join`, without encoding twice)."""

    chunks: tuple[Chunk, ...] = ()

    @staticmethod
    def join(encoded: list[bytes]) -> bytes:
        """The wire bytes of a frame of already-encoded chunks (``Chunk.encode()`` each, in order)."""
        return b'{"chunks":[' + b",".join(encoded) + b"]}"

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> "StepFrame":
        """Decode; ValueError if ``chunks`` is not a list of chunk objects (or one of them lacks a field)."""
        items = obj.get("chunks")
        if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
            raise ValueError("StepFrame: 'chunks' must be a list of objects")
        return cls(tuple(Chunk.from_dict(x) for x in items))


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
    recompute-preempting that one; "" = an ordinary dispatch within the worker's credits.

    ``urgent``: the request's tenant holds less than its fair share of the service (or the request is
    ``interactive`` while ``batch`` work runs): the worker queues it ahead of waiting ordinary work and
    gives its prefill the next step (docs/decisions/0021-latency-isolation.md)."""

    request: GenerateRequest
    scheduler_id: str = ""
    preempt: str = ""
    urgent: bool = False

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> "Dispatch":
        """Decode, rebuilding the nested GenerateRequest."""
        req = obj.get("request")
        if not isinstance(req, dict):
            raise ValueError("Dispatch: 'request' must be an object")
        return cls(request=GenerateRequest.from_dict(req), scheduler_id=str(obj.get("scheduler_id", "")),
                   preempt=str(obj.get("preempt") or ""), urgent=bool(obj.get("urgent", False)))


@dataclass(frozen=True)
class DispatchAck(Message):
    """Worker -> scheduler reply to a Dispatch: accepted, or refused (no credit, draining)."""

    accepted: bool
    reason: str = ""


@dataclass(frozen=True)
class HopAck(Message):
    """A hop's answer to a hand-off: the validator's to a gateway's ``ApiRequest`` (``as.int.validate``), the
    scheduler's to a validator's submit and to a worker's hand-over of a migrated sequence.

    ``accepted``: the receiver took the request (it answers for it from now on). ``error``: when refused,
    why, as the wire error dict (``bus.errors.ServeError.to_wire()``: status, message, type, param, code,
    retryable, retry_after, and a scheduler's refusal hints); None when accepted or when the receiver gave no
    reason. Wire: ``{"accepted": bool, "error": {...} | null}``; the older ``{"accepted":true}`` decodes too.
    (The worker's answer to a ``Dispatch`` is :class:`DispatchAck`.)"""

    accepted: bool
    error: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.error is not None and not isinstance(self.error, dict):
            raise ValueError("HopAck.error must be an object or null")

    @property
    def code(self) -> str | None:
        """The refusal's ``code`` (None when accepted or refused without one)."""
        return (self.error or {}).get("code")

    @property
    def failure(self) -> ServeError | None:
        """The refusal as a :class:`bus.errors.ServeError` (None when accepted or refused without a reason)."""
        return ServeError.from_wire(self.error) if self.error is not None else None


@dataclass(frozen=True)
class ValidatorPing(Message):
    """Gateway -> ``as.int.validate``: is any validator there? (the readiness check, gateway/http.py).

    Wire: ``{"ping": true}``, answered by :class:`ValidatorPong`. Told from an ``ApiRequest`` by
    :meth:`matches` on the decoded object (it has ``ping`` and no ``request_id``)."""

    ping: bool = True

    @staticmethod
    def matches(obj: Any) -> bool:
        """Whether a decoded JSON object is a ping (not an ApiRequest)."""
        return isinstance(obj, dict) and obj.get("ping") is True and "request_id" not in obj


@dataclass(frozen=True)
class ValidatorPong(Message):
    """A validator's answer to :class:`ValidatorPing`. Wire: ``{"pong": true}``."""

    pong: bool = True


@dataclass(frozen=True)
class ReceiverProbe(Message):
    """Worker -> a request's reply subject (request-reply): does its receiver still wait for it?

    ``probe``: the request id asked about (the field keeps the name of the older untyped probe,
    ``{"probe": "<id>"}``, so gateways of either version answer). Told from a ``Chunk`` by :meth:`matches`
    on the decoded object. Answered by :class:`ProbeAnswer`."""

    probe: str

    @property
    def request_id(self) -> str:
        """The request asked about."""
        return self.probe

    @staticmethod
    def matches(obj: Any) -> bool:
        """Whether a decoded JSON object is a probe (not a Chunk)."""
        return isinstance(obj, dict) and isinstance(obj.get("probe"), str) and "seq" not in obj


@dataclass(frozen=True)
class ProbeAnswer(Message):
    """The receiver's answer to :class:`ReceiverProbe`: ``alive`` True while it waits for the request's chunks.
    Wire: ``{"alive": bool}``; an answer without the field reads as alive (a busy or older receiver)."""

    alive: bool = True


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
    # measured engine speed (0 = not measured yet), for the scheduler's completion-time prediction:
    step_ms: float = 0.0  # decode step at the current batch (engine EWMA per batch size) + the worker loop's own (ms)
    prefill_tokens_per_s: float = 0.0  # prompt tokens computed per second of step time (EWMA, tokens/s)
    # tokens computed per tenant since the previous heartbeat: {tenant: [prompt tokens, completion tokens]}
    # (VTC service counters, docs/decisions/0021-latency-isolation.md; lost heartbeats lose only these counts)
    served: dict = field(default_factory=dict)
    paused: list | None = None  # ids of requests held here that wait to resume after a preemption (None: not told)
    sleeping: bool = False  # the worker sleeps (actors/worker/sleep.py): no work until woken; draining is set too


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
    num_constrained_steps: int = 0  # engine steps with >= 1 grammar-constrained sequence
    grammar_compile_ms_total: float = 0.0  # time spent compiling grammars (ms, cache misses only)
    grammar_cache_hits: int = 0  # requests whose grammar came from the compiled-grammar LRU
    grammar_cache_misses: int = 0  # requests whose grammar was compiled
    # prompt tokens found in the prefix cache per tenant, since the worker started: {tenant: tokens}
    prefix_hits_by_tenant: dict = field(default_factory=dict)
    num_kv_reclaims: int = 0  # sequences preempted to give a waiting tenant its KV share (kv_share.py)


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
    timing: dict[str, float]  # ms, keys: docs/architecture.md "Conventions"
    priority: str = "interactive"
    error_code: str | None = None
    worker_id: str = ""
    ts: float = 0.0
    choice_index: int = 0  # the request's GenerateRequest.choice_index (metering counts choice 0's prompt)
    tool_calls: int = 0  # tool calls parsed out of the output (finish_reason "tool_calls" when > 0)


@dataclass(frozen=True)
class ActorLoad(Message):
    """One actor's load report (~1 Hz) on ``as.int.load.<kind>.<actor_id>`` (bus.subjects.load_subject), read
    by the autoscaler (actors/load_report.py builds it). Figures cover the ``window_s`` seconds before ``ts``.
    The scheduler extras (``name`` .. ``cold_start_waiting``) are set by the active scheduler of a version only
    (actors/scheduler/load.py); their tokens are generated (completion) tokens, the unit of the throughput
    curves (control/policy/curves.py). ValueError on a negative or non-finite figure."""

    kind: str  # actor kind: "validator" | "gateway" | "scheduler"
    actor_id: str  # the reporting process (subject token)
    ts: float  # send time, Unix epoch s
    window_s: float  # seconds the figures cover (since the previous report)
    loop_lag_ms_p95: float = 0.0  # event-loop lag p95 over the window: sleep drift while this process ran (ms)
    cpu_util: float = 0.0  # process CPU seconds per wall second over the window (all threads; may exceed 1)
    pending: int = 0  # messages taken or delivered but not yet handled (subscription pending + internal backlog)
    wait_ms_p90: float = 0.0  # queue wait p90 of the messages handled in the window (enqueue mark -> handling, ms)
    handled: int = 0  # messages handled in the window
    loop_drift_ms_p95: float = 0.0  # raw sleep drift p95 (ms; loop_lag_ms_p95 counts only what this process ran)
    name: str = ""  # scheduler: model name
    version: str = ""  # scheduler: model version
    queue_tokens: float = 0.0  # scheduler: completion tokens the queued requests are expected to generate
    queue_len: int = 0  # scheduler: requests queued
    arrivals_tokens_per_s: float = 0.0  # scheduler: tokens submitted per s (refused ones included: demand)
    served_tokens_per_s: float = 0.0  # scheduler: tokens generated per s by its workers (their heartbeats)
    workers: int = 0  # scheduler: live (leased) workers of the version
    cold_start_waiting: int = 0  # scheduler: requests held because the version has no live worker
    # scheduler: [[tenant, service share, weight share], ...] (fractions 0..1 over the last 60 s; the operator
    # dashboard's "share of service against weight", gateway/dashboard_data.py); at most MAX_LOAD_TENANTS
    tenants: tuple = ()

    def __post_init__(self) -> None:
        for f in ("ts", "window_s", "loop_lag_ms_p95", "loop_drift_ms_p95", "cpu_util", "pending", "wait_ms_p90",
                  "handled", "queue_tokens", "queue_len", "arrivals_tokens_per_s", "served_tokens_per_s", "workers",
                  "cold_start_waiting"):
            v = getattr(self, f)
            if not is_number(v, minimum=0):
                raise ValueError(f"ActorLoad.{f} must be a finite number >= 0, got {v!r}")
        object.__setattr__(self, "tenants", _tenant_shares(self.tenants))


MAX_LOAD_TENANTS = 50  # ActorLoad.tenants entries at most (the scheduler's tenant label bound)


def _tenant_shares(rows: Any) -> tuple:
    """``ActorLoad.tenants`` checked: at most MAX_LOAD_TENANTS ``[tenant, service share, weight share]``, shares
    in 0..1; ValueError naming the field otherwise."""
    share = (lambda v: is_number(v) and 0 <= v <= 1.000001)
    if not isinstance(rows, (list, tuple)) or len(rows) > MAX_LOAD_TENANTS or not all(
            isinstance(r, (list, tuple)) and len(r) == 3 and isinstance(r[0], str) and share(r[1]) and share(r[2])
            for r in rows):
        raise ValueError(f"ActorLoad.tenants must be at most {MAX_LOAD_TENANTS} [tenant, service share 0..1, "
                         f"weight share 0..1] entries, got {rows!r:.200}")
    return tuple((r[0], float(r[1]), float(r[2])) for r in rows)
