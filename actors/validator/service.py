"""Validator service: validate, template, tokenize, then hand to the version's scheduler.

Listens on ``as.int.validate`` (queue group "validators"). Each ApiRequest is acked at once (so the
gateway knows a validator took it), then processed off the event loop (CPU work in threads, bounded
concurrency). Bad input ends here with a final error Chunk on the request's reply subject naming the
field; a missing or full scheduler ends it with a retryable 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

import orjson

from actors.recent import RecentIds
from actors.validator.errors import RequestError
from actors.text import reasoning
from actors.text.tool_calls import FORMATS as TOOL_CALL_FORMATS
from actors.validator.sampling import default_max_tokens, sampling_params
from actors.validator.tools import check_format
from actors.validator.validation import (MAX_CHOICES, MAX_N, ValidatedRequest, default_stop_token_ids,
                                         prepare_prompt, validate_request)
from actors import content_log
from actors.load_report import LoadReporter, new_actor_id
from bus.errors import ServeError
from bus import subjects, tracing
from bus.base import Bus, BusDisconnected, BusError, BusTimeout, Msg, NoResponders
from bus.messages import (ApiRequest, Cancel, Chunk, GenerateRequest, HopAck, SamplingParams, ValidatorPing,
                          ValidatorPong, choice_request_id, sampling_defaults)

log = logging.getLogger(__name__)


RETRIED_REFUSALS = frozenset({"journal_unavailable"})  # scheduler refusals the validator retries (see _submit)
# refusal fields passed on to the gateway besides the error's own (the scheduler's Retry-After, e.g. a cold
# start's, actors/scheduler/load.py, travels as ServeError.retry_after): shedding hints (gateway/shed.py)
HINT_FIELDS = ("queue_clear_at", "decode_step_s")
# requests prepared on the event loop instead of a thread (decision 0029): prompt text of at most INLINE_CHARS
# characters and none of the fields whose checks can take long (grammar compilation, tool prompts)
INLINE_CHARS = 2000
REASONING_TAIL = 16  # prompt tokens decoded to tell where a reasoning model's output starts (reasoning.prompt_state)
SLOW_FIELDS = ("tools", "functions", "response_format", "structured_outputs", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar", "guided_decoding_backend")


def prepare_inline(body: dict) -> bool:
    """True for a short plain request: its messages' string contents (or its string prompt) total at most
    ``INLINE_CHARS`` characters and it has none of ``SLOW_FIELDS``. Preparing such a request (template,
    tokenizer: tens of µs) costs less than the thread hand-off and wake-up of ``asyncio.to_thread``."""
    if not isinstance(body, dict) or any(k in body for k in SLOW_FIELDS):
        return False
    if isinstance(body.get("prompt"), str):
        return len(body["prompt"]) <= INLINE_CHARS
    msgs = body.get("messages")
    if not isinstance(msgs, list) or "prompt" in body:
        return False
    total = 0
    for m in msgs:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, str):
            return False
        total += len(content)
    return total <= INLINE_CHARS


@dataclass
class ModelAssets:
    """What validation needs of one model version (loaded once per version)."""

    tokenizer: object  # actors.text.loader.TextTokenizer (GGUFTokenizer or HFTokenizer)
    chat_template: str | None
    max_model_len: int  # context length (tokens)
    stop_token_ids: tuple[int, ...]  # EOS + end-of-turn + the tokenizer's end-of-generation ids
    defaults: dict = field(default_factory=dict)  # the manifest's sampling defaults (checked, normalized)
    tool_call_format: str | None = None  # the manifest's tool_call_format (docs/tools.md); None: no tools
    reasoning_format: str | None = None  # the manifest's or the template's (actors/text/reasoning.py); None: none


def load_assets(manifest: dict) -> ModelAssets:
    """Build tokenizer, template and sampling defaults from a manifest (blocking: run in a thread).

    ValueError if unsupported, including sampling ``defaults`` the engine cannot honour (a record written
    before registration refused them): such a version answers 503 rather than ignore its defaults."""
    from actors.text.loader import load_tokenizer
    if manifest.get("format", "gguf") not in ("gguf", "hf"):
        raise ValueError(f"format {manifest.get('format')!r} is not supported yet (supported: gguf, hf)")
    defaults = sampling_defaults(manifest.get("defaults") or {})
    tok = load_tokenizer(manifest["artifact"])  # a GGUF file, or an HF directory once formats allow it
    template = manifest.get("chat_template")
    template = tok.chat_template if template in (None, "gguf") else template
    ctx = int(manifest.get("context_length") or getattr(tok, "context_length", None) or 2048)
    tool_format = manifest.get("tool_call_format")
    if tool_format is not None and tool_format not in TOOL_CALL_FORMATS:
        raise ValueError(f"tool_call_format {tool_format!r} is not supported (supported: {', '.join(TOOL_CALL_FORMATS)})")
    think = reasoning.resolve_format(manifest.get("reasoning_format"), template)
    reasoning.check_vocabulary(think, tok.special_tokens)  # tags the detokenizer drops: refused, not served wrong
    return ModelAssets(tok, template, ctx, default_stop_token_ids(tok, template), defaults, tool_format, think)


@dataclass
class ValidatorConfig:
    """Limits of one validator (ValueError on bad values)."""

    max_tokens_cap: int = 4096  # server-side cap on generated tokens per request
    max_concurrency: int = 64  # requests processed at once
    scheduler_ack_s: float = 2.0  # wait for the scheduler to take a request (s)
    failover_wait_s: float = 4.0  # keep retrying while no scheduler is active (election in progress) (s)
    max_n: int = MAX_N  # server cap on `n`
    max_choices: int = MAX_CHOICES  # server cap on n x prompts (engine requests per API request)
    test_delay_ms: float = 0.0  # test only (ACTORSERVE_TEST_FAULTS=1, checked by the actor): CPU burnt per request

    def __post_init__(self) -> None:
        if min(self.max_tokens_cap, self.max_concurrency, self.max_n, self.max_choices) < 1 \
                or self.scheduler_ack_s <= 0:
            raise ValueError("validator limits must be positive")


def _burn_cpu(seconds: float) -> None:
    """Test-only slowdown: spin in Python (holding the GIL) until this thread has used ``seconds`` of CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class ValidatorService:
    """Processes ApiRequests from the validators queue group."""

    def __init__(self, bus: Bus, registry, cfg: ValidatorConfig | None = None, *, fault=None,
                 actor_id: str | None = None) -> None:
        """``fault``: the test-only delay (actors/validator/faults.py) or None; ``actor_id``: the id of this
        validator's load reports (``as.int.load.validator.<id>``; default ``validator-<pid>-<hex>``)."""
        self.bus, self.registry, self.cfg = bus, registry, cfg or ValidatorConfig()
        self.fault = fault
        self._seen = RecentIds(ttl_s=60.0)  # hand-offs taken lately ("<request id>|<gateway_out mark>")
        self._queued: set[str] = set()  # request ids taken and not started yet (semaphore, delay fault)
        self.load = LoadReporter(bus, "validator", actor_id or new_actor_id("validator"), pending=self._backlog)
        self._assets: dict[tuple[str, str], asyncio.Future] = {}
        self._sem = asyncio.Semaphore(self.cfg.max_concurrency)
        self._tasks: set[asyncio.Task] = set()
        self._sub = None
        self._cancel_sub = None
        self._working: set[str] = set()  # request ids being validated here
        self._cancelled: set[str] = set()  # ... of which a cancel was heard

    async def start(self) -> None:
        """Join the validators queue group."""
        self._sub = await self.bus.subscribe(subjects.VALIDATE, self._on_msg, queue=subjects.VALIDATORS_QUEUE)
        self._cancel_sub = await self.bus.subscribe(subjects.cancel_all(), self._on_cancel)
        await self.load.start()

    def _backlog(self) -> int:
        """Messages waiting here: delivered and not yet taken (subscription) plus taken and not started."""
        sub_pending = self._sub.pending() if self._sub is not None and hasattr(self._sub, "pending") else 0
        return sub_pending + len(self._queued)

    async def _on_cancel(self, msg: Msg) -> None:
        """Remember cancels of requests being validated here (a client may hang up during tokenization)."""
        rid = msg.subject.rsplit(".", 1)[-1]
        if rid in self._working:
            self._cancelled.add(rid)

    async def stop(self, timeout: float = 10.0) -> None:
        """Leave the queue group and finish requests already taken (bounded)."""
        for sub in (self._sub, self._cancel_sub):
            if sub:
                await sub.unsubscribe()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        await self.load.stop()

    async def _on_msg(self, msg: Msg) -> None:
        try:
            obj = orjson.loads(msg.data)
            if ValidatorPing.matches(obj):
                return await msg.respond(ValidatorPong().encode()) if msg.reply else None
            req = ApiRequest.from_dict(obj) if isinstance(obj, dict) else ApiRequest.decode(msg.data)
        except ValueError as exc:  # orjson.JSONDecodeError is a ValueError
            log.warning("undecodable ApiRequest: %s", exc)
            return await msg.respond(HopAck(False).encode()) if msg.reply else None
        if msg.reply:
            await msg.respond(HopAck(True).encode())
        attempt = f"{req.request_id}|{req.marks.get('gateway_out')}"  # the same hand-off, not the same id
        if self._seen.get(attempt) is not None:  # a gateway asking again after a late ack: handled once here
            return
        self._seen.add(attempt)
        task = asyncio.create_task(tracing.traced(  # a span around the processing: the hop to the scheduler
            "validation", self._process(replace(req, marks={**req.marks, "validate_in": time.time()})),
            {"actorserve.request_id": req.request_id, "actorserve.model_version": f"{req.name}@{req.version}"}))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def assets(self, name: str, version: str) -> ModelAssets:
        """Assets of a version, loaded once (concurrent callers share the load). RequestError 404/503."""
        key = (name, version)
        if key not in self._assets:
            self._assets[key] = asyncio.ensure_future(self._load(name, version))
        try:
            return await asyncio.shield(self._assets[key])
        except RequestError:
            self._assets.pop(key, None)
            raise

    async def _load(self, name: str, version: str) -> ModelAssets:
        try:
            manifest = await self.registry.get_model_version(name, version)
        except Exception as exc:  # etcd away and this version not cached yet: a retryable 503, not a 500
            log.warning("registry unavailable while loading %s@%s: %r", name, version, exc)
            raise RequestError(503, "the model registry is unavailable right now; retry", code="registry_unavailable",
                               type="unavailable") from exc
        if manifest is None:
            raise RequestError(404, f"The model `{name}@{version}` does not exist or you do not have access to it.",
                               param="model", code="model_not_found")
        try:
            return await asyncio.to_thread(load_assets, manifest)
        except (OSError, ValueError) as exc:
            log.warning("model %s@%s cannot be loaded: %s", name, version, exc)  # details for the operator only
            raise RequestError(503, f"model {name}@{version} cannot be loaded; see the validator's log",
                               code="model_unavailable",
                               type="unavailable") from exc

    async def _process(self, req: ApiRequest) -> None:
        self._working.add(req.request_id)
        self._queued.add(req.request_id)
        try:
            await self._process_one(req)
        finally:
            self._queued.discard(req.request_id)
            self._working.discard(req.request_id)
            self._cancelled.discard(req.request_id)

    async def _turn(self, req: ApiRequest) -> None:
        """The request's turn: its queue wait (from the gateway's hand-off) ends and is reported; with the
        test-only delay fault, first wait for this validator's turn and be held (one at a time)."""
        def started() -> None:
            self._queued.discard(req.request_id)
            self.load.waited(req.marks.get("gateway_out") or req.marks.get("validate_in"))
        if self.fault is None:
            return started()
        await self.fault.hold(started)

    async def _process_one(self, req: ApiRequest) -> None:
        async with self._sem:
            await self._turn(req)
            try:
                gens = await self._prepare(req)
                if req.request_id in self._cancelled:  # the client left while we tokenized: never schedule it
                    return await self._fail(req, ServeError(499, "request cancelled", type="cancelled",
                                                             code="cancelled").to_wire())
                await self._submit_all(gens)
            except RequestError as err:
                retry = err.status >= 500 or err.status == 429  # overload / quota: try again later
                after = err.retry_after if err.retry_after is not None else 1.0 if retry else None
                await self._fail(req, replace(err, retryable=retry, retry_after=after).to_wire())
            except Exception as exc:  # a bug must answer (500), never leave the client waiting
                log.exception("validation of %s failed", req.request_id)
                await self._fail(req, ServeError(500, f"internal error while validating the request: {exc}",
                                                  type="server_error", code="internal_error").to_wire())

    async def _prepare(self, req: ApiRequest) -> list[GenerateRequest]:
        """Validate and tokenize (in a thread). Raises RequestError."""
        if req.deadline and time.time() > req.deadline:
            raise RequestError(503, "the request's deadline passed before validation", code="deadline_exceeded",
                               type="timeout")
        assets = await self.assets(req.name, req.version)
        if self.cfg.test_delay_ms <= 0 and prepare_inline(req.body):
            return self._prepare_sync(req, assets)
        return await asyncio.to_thread(self._prepare_sync, req, assets)

    def _prepare_sync(self, req: ApiRequest, assets: ModelAssets) -> list[GenerateRequest]:
        """One GenerateRequest per choice. A single choice keeps the request id; several (``n`` > 1 or a
        list of prompts) get ids ``<id>-<index>`` and ``choice_index`` = prompt_index * n + i and, when a
        seed is set, seeds ``seed + i``."""
        if self.cfg.test_delay_ms > 0:
            _burn_cpu(self.cfg.test_delay_ms / 1e3)
        validated = validate_request(req.endpoint, req.body, self.cfg.max_n, self.cfg.max_choices)
        parser = check_format(validated.tools, assets.tool_call_format, f"{req.name}@{req.version}")  # 400 naming tools
        tools = validated.tools
        tool_kw = {} if parser is None else dict(tool_parser=parser, parallel_tool_calls=tools.parallel,
                                                 tool_calls_forced=tools.forced)
        prepared = [self._prepare_prompt(req, validated, p, assets) for p in validated.prompts or (validated.prompt,)]
        n, marks = validated.n, {**req.marks, "validate_out": time.time()}
        out = []
        for pi, (ids, params, echo, think) in enumerate(prepared):
            for i in range(n):
                index = pi * n + i
                rid = req.request_id if n * len(prepared) == 1 else choice_request_id(req.request_id, index)
                out.append(GenerateRequest(rid, req.tenant, req.name, req.version, req.reply, tuple(ids),
                                           params.seeded(i), req.priority, req.deadline, marks, echo_text=echo,
                                           choice_index=index, adapter=req.adapter,
                                           adapter_path=req.adapter_path, frames=req.frames, **tool_kw, **think))
        return out

    def _prepare_prompt(self, req: ApiRequest, validated: ValidatedRequest, prompt, assets: ModelAssets
                        ) -> tuple[list[int], SamplingParams, str, dict]:
        """``(prompt token ids, sampling params, echo text, reasoning fields of its GenerateRequest)`` of one
        prompt. A chat prompt of a reasoning model: where its output starts (the rendered prompt's end,
        actors/text/reasoning.py ``prompt_state``) and its grammar applied after the thinking. Raises RequestError."""
        v = replace(validated, prompt=prompt) if validated.kind == "completion" else validated
        ids, max_tokens = prepare_prompt(v, assets.tokenizer, assets.chat_template, assets.max_model_len,
                                         default_max_tokens(req.endpoint, assets.defaults), self.cfg.max_tokens_cap,
                                         assets.tool_call_format)
        content_log.log_content("prompt token ids", req.request_id, list(ids))  # ACTORSERVE_LOG_PROMPTS=1 only
        echo = "" if not v.echo else prompt if isinstance(prompt, str) else assets.tokenizer.decode(ids)
        think: dict = {}
        if v.kind == "chat" and assets.reasoning_format is not None:
            state = reasoning.prompt_state(assets.tokenizer.decode(ids[-REASONING_TAIL:], skip_special_tokens=False))
            think = {"reasoning_parser": assets.reasoning_format, "reasoning_state": state}
            v = replace(v, grammar=reasoning.think_grammar(v.grammar, state))
        return ids, sampling_params(v, max_tokens, assets.stop_token_ids, assets.defaults), echo, think

    async def _submit_all(self, gens: list[GenerateRequest]) -> None:
        """Submit every choice; if one is refused, cancel those already taken and raise its error."""
        for j, gen in enumerate(gens):
            try:
                await self._submit(gen)
            except RequestError:
                for done in gens[:j]:
                    try:
                        await self.bus.publish(subjects.cancel(done.request_id),
                                               Cancel(done.request_id, "sibling_failed", done.tenant).encode())
                    except BusError as exc:
                        log.warning("cancel of %s failed: %s", done.request_id, exc)
                raise

    async def _submit(self, gen: GenerateRequest) -> None:
        """Hand to the active scheduler; RequestError 503 if none answers or it refuses.

        No responders (no active scheduler: a failover in progress) is retried every 0.2 s for up to
        ``failover_wait_s``, within the request's deadline: nobody received it, so a retry cannot
        duplicate it. A timeout (a busy scheduler, or its ack lost) is retried the same way: the scheduler
        acks a submit it took within a minute (same id and ``validate_out`` mark) without queueing it again. A refusal with
        a code of RETRIED_REFUSALS (the scheduler could not journal it: a JetStream leader election, e.g.
        after a partition heals) is retried the same way: the scheduler said it did not take the request."""
        give_up = min(time.time() + self.cfg.failover_wait_s, gen.deadline or float("inf"))
        try:
            while True:
                try:
                    reply = await self.bus.request(subjects.sched_submit(gen.name, gen.version), gen.encode(),
                                                   self.cfg.scheduler_ack_s)
                    ack = HopAck.decode(reply.data)
                except (NoResponders, BusTimeout):
                    ack = None
                    if time.time() + 0.2 >= give_up:
                        raise
                if ack is not None and (ack.accepted or ack.code not in RETRIED_REFUSALS
                                        or time.time() + 0.2 >= give_up):
                    break
                await asyncio.sleep(0.2)
        except (NoResponders, BusTimeout, BusDisconnected, BusError, ValueError) as exc:
            raise RequestError(503, f"no scheduler is available for {gen.model_ref}; retry later",
                               code="scheduler_unavailable", type="unavailable") from exc
        if not ack.accepted:
            err = ack.error or {}
            raise ServeError(int(err.get("status", 503)), err.get("message", "refused by the scheduler"),
                             err.get("param"), err.get("code"), err.get("type") or "unavailable", err.get("retry_after"),
                             extra={k: err[k] for k in HINT_FIELDS if err.get(k) is not None})

    async def _fail(self, req: ApiRequest, err: dict) -> None:
        tracing.set_error(f"{err.get('code') or err.get('status')}: {err.get('message')}")
        chunk = Chunk(req.request_id, 0, final=True, finish_reason="abort", error=err,
                      model=f"{req.name}@{req.version}")
        try:
            await self.bus.publish(req.reply, chunk.encode())
        except BusError as exc:
            log.warning("could not report error for %s: %s", req.request_id, exc)
