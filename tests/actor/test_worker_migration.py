"""Sequences migrated between workers (actors/worker/migration.py, actors/scheduler/resume.py) on the
in-memory bus: a real scheduler and two workers running the real engine on the tiny GGUF model.

Every check compares with an uninterrupted run of the same requests on a fresh engine (the reference),
never with the migrated run itself: the migrated streams carry the same tokens, the same text, the same
usage, one gap-free chunk sequence whose worker changes once, and one completion record."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from actors.scheduler.service import SchedulerConfig, SchedulerService
from actors.worker.engine.engine import EngineConfig, LLMEngine
from actors.worker.engine.types import EngineRequest
from actors.worker.service import WorkerConfig, WorkerService
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import Chunk, CompletionRecord, GenerateRequest, SamplingParams
from tests.actor.test_worker_service import collect, tiny_path, wait_final  # noqa: F401

PROMPT = (5, 6, 7, 8, 9, 10, 11)


def engine(path: str) -> LLMEngine:
    """float32: the receiver's one-prefill recompute then gives the logits of the decode steps it replaces to
    ~1e-6 (bfloat16 differs by ~2e-2, enough to move a sampled draw across a token boundary)."""
    return LLMEngine(EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=2_000_000, max_num_seqs=4,
                                  progress=False))


def requests() -> list[GenerateRequest]:
    """Greedy, seeded sampled with penalties and a stop string, logprobs: what the receiver must carry on."""
    smp = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
           SamplingParams(max_tokens=48, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True,
                          frequency_penalty=0.4, repetition_penalty=1.1),
           SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2),
           SamplingParams(max_tokens=48, temperature=0.7, seed=99, ignore_eos=True, stop=("ab",))]
    return [GenerateRequest(f"r{i}", "t", "m", "1", f"_INBOX.t.r{i}", PROMPT[: 4 + i], s,
                            deadline=time.time() + 60) for i, s in enumerate(smp)]


def reference(path: str, reqs: list[GenerateRequest]) -> dict[str, tuple[list[int], str]]:
    """(tokens, text) per request from an uninterrupted engine run."""
    eng, out = engine(path), {r.request_id: ([], []) for r in requests()}
    for r in reqs:
        eng.add_request(EngineRequest(r.request_id, r.prompt_token_ids, r.sampling))
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].append(o.text)
    return {rid: (toks, "".join(texts)) for rid, (toks, texts) in out.items()}


async def stack(path: str):
    """(bus, scheduler, w1, w2): both workers started; only w1 leased so far."""
    bus = MemoryBus()
    sched = SchedulerService(bus, SchedulerConfig("m", "1", drain_s=0.2))
    await sched.start()
    w1, w2 = (WorkerService(bus, engine(path), WorkerConfig(w, "m", "1")) for w in ("w1", "w2"))
    await w1.start()
    await w2.start()
    sched.on_worker_lease("w1", True)
    return bus, sched, w1, w2


async def stop(sched, *workers) -> None:
    for w in workers:
        await w.stop()
    await sched.stop(fail_queued=False)


async def submit_all(bus, reqs) -> dict[str, list[Chunk]]:
    chunks = {r.request_id: await collect(bus, r.reply) for r in reqs}
    for r in reqs:
        reply = await bus.request(subjects.sched_submit("m", "1"), r.encode(), 1.0)
        assert b'"accepted":true' in reply.data
    return chunks


async def until(cond, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.002)


def assert_like_reference(chunks: list[Chunk], ref: tuple[list[int], str]) -> None:
    assert [c.seq for c in chunks] == list(range(len(chunks)))  # one gap-free sequence, nothing repeated
    assert chunks[-1].final and chunks[-1].error is None
    assert [t for c in chunks for t in c.token_ids] == ref[0]
    assert "".join(c.text for c in chunks) == ref[1]
    usage = chunks[-1].usage
    assert usage == {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": len(ref[0]),
                     "total_tokens": usage["prompt_tokens"] + len(ref[0]),
                     "prompt_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}}


async def test_a_notice_moves_running_sequences_and_they_continue_identically(tiny_path):
    reqs = requests()
    ref = reference(tiny_path, reqs)
    bus, sched, w1, w2 = await stack(tiny_path)
    records = await collect(bus, subjects.done("m", "1"), CompletionRecord)
    w1.engine.step = slowed(w1.engine.step)  # ~40 steps per second: the notice lands mid-stream
    chunks = await submit_all(bus, reqs)
    await until(lambda: all(len(c) >= 4 for c in chunks.values()))
    sched.on_worker_lease("w2", True)
    await until(lambda: "w2" in sched.table.workers and sched.table.workers["w2"].free_slots > 0)
    w1.migration.notice(time.time() + 30, "test")
    for c in chunks.values():
        await wait_final(c)
    await asyncio.sleep(0.1)
    for r in reqs:
        c = chunks[r.request_id]
        assert_like_reference(c, ref[r.request_id])
        workers = [x.worker_id for x in c]
        assert workers[0] == "w1" and workers[-1] == "w2" and workers == sorted(workers), workers  # moved once
        assert c[-1].usage["prompt_tokens"] == len(r.prompt_token_ids)
    assert w1.migration.num_out == len(reqs) and w1.migration.num_kept == 0
    assert sorted((x.request_id, x.worker_id, x.completion_tokens) for x in records) == sorted(
        (r.request_id, "w2", len(ref[r.request_id][0])) for r in reqs)  # one record each, from the receiver
    assert len(w2.migration.gaps_ms) == len(reqs) and max(w2.migration.gaps_ms) < 5000
    assert chunks["r2"][-1].logprobs is not None and all(x.logprobs is not None for x in chunks["r2"])
    assert not w1.live and w1.engine.credits()[0] == w1.engine.stats().num_total_blocks
    await stop(sched, w1, w2)


def slowed(step, delay_s: float = 0.025):
    """``engine.step`` that takes at least ``delay_s`` (runs in the worker's step thread)."""
    def slow():
        time.sleep(delay_s)
        return step()
    return slow


async def test_without_another_worker_the_sequence_finishes_in_place(tiny_path):
    reqs = requests()[:2]
    ref = reference(tiny_path, reqs)
    bus, sched, w1, w2 = await stack(tiny_path)
    w1.engine.step = slowed(w1.engine.step)
    chunks = await submit_all(bus, reqs)
    await until(lambda: all(len(c) >= 3 for c in chunks.values()))
    w1.migration.notice(time.time() + 30, "test")  # w2 is not leased: nobody can take them
    for c in chunks.values():
        await wait_final(c)
    for r in reqs:
        assert_like_reference(chunks[r.request_id], ref[r.request_id])
        assert {x.worker_id for x in chunks[r.request_id]} == {"w1"}
    assert w1.migration.num_out == 0 and w1.migration.num_kept >= len(reqs)
    await stop(sched, w1, w2)


async def test_at_the_notice_deadline_what_is_left_ends_with_a_retryable_503(tiny_path):
    bus, sched, w1, w2 = await stack(tiny_path)
    w1.engine.step = slowed(w1.engine.step)
    req = dataclasses.replace(requests()[0], sampling=SamplingParams(max_tokens=400, temperature=0.0,
                                                                     ignore_eos=True))
    chunks = await submit_all(bus, [req])
    await until(lambda: len(chunks[req.request_id]) >= 2)
    w1.migration.notice(time.time() + 0.5, "test")
    await wait_final(chunks[req.request_id])
    err = chunks[req.request_id][-1].error
    assert err["code"] == "worker_preempted" and err["retryable"] and err["status"] == 503
    assert [c.seq for c in chunks[req.request_id]] == list(range(len(chunks[req.request_id])))
    assert not w1.live and w1.can_accept(req) is False  # draining: takes no more work
    await stop(sched, w1, w2)


async def test_a_drain_with_a_live_peer_moves_the_sequences_instead_of_waiting(tiny_path):
    reqs = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_tokens=200)) for r in requests()[:2]]
    ref = reference(tiny_path, reqs)
    bus, sched, w1, w2 = await stack(tiny_path)
    w1.engine.step = slowed(w1.engine.step)
    chunks = await submit_all(bus, reqs)
    await until(lambda: all(len(c) >= 3 for c in chunks.values()))
    sched.on_worker_lease("w2", True)
    await until(lambda: "w2" in sched.table.workers and sched.table.workers["w2"].free_slots > 0)

    async def peers() -> int:
        return 1
    w1.migration.peers = peers
    t0 = time.monotonic()
    await w1.drain(timeout=20.0)
    took = time.monotonic() - t0
    for c in chunks.values():
        await wait_final(c)
    for r in reqs:
        assert_like_reference(chunks[r.request_id], ref[r.request_id])
        assert chunks[r.request_id][-1].worker_id == "w2"
    assert took < 2.5, took  # the streams had ~5 s left on w1 (200 steps of >= 25 ms), the drain timeout 20 s
    await stop(sched, w1, w2)


async def test_sigusr1_and_the_notice_key_reach_the_migrator(tiny_path):
    import os
    import signal

    from actors.worker import actor
    from control.state.names import preemption_notice_key

    class Reg:  # the registry calls the worker makes for notices and peers
        def __init__(self) -> None:
            self.events: asyncio.Queue = asyncio.Queue()

        async def list_workers(self, name, version):
            return {"w1": {}, "w2": {}}

        def watch_prefix(self, prefix, include_existing=False):
            async def gen():
                while True:
                    yield await self.events.get()
            return gen()

    class Ctx:
        closers: list = []

        def on_stop(self, closer, timeout_s, what):
            self.closers.append(closer)

    reg, ctx = Reg(), Ctx()
    svc = WorkerService(MemoryBus(), engine(tiny_path), WorkerConfig("w1", "m", "1"))
    actor._watch_notices(ctx, reg, svc, type("Ref", (), {"name": "m", "version": "1"}), "w1")
    assert await svc.migration.peers() == 1  # the other leased worker of the version
    os.kill(os.getpid(), signal.SIGUSR1)
    await until(lambda: svc.draining)
    assert abs(svc.migration.deadline - (time.time() + 120)) < 5 and svc.migration.reason == "SIGUSR1"
    key = preemption_notice_key("w1")
    for ev in (("put", key + "0", {"deadline": time.time() + 1}),  # another worker's (w10) key
               ("put", key, {"deadline": time.time() - 3600}),  # left by an earlier process with this id
               ("put", key, {"deadline": "soon"}),  # malformed
               ("put", key, {"deadline": time.time() + 5, "reason": "spot"})):
        await reg.events.put(ev)
    await until(lambda: svc.migration.reason == "spot")
    assert abs(svc.migration.deadline - (time.time() + 5)) < 1
    for closer in ctx.closers:
        await closer()


def test_a_constrained_sampled_sequence_resumes_on_the_grammar_and_rng_where_it_stopped(tiny_path):
    """Engine level (float32, tiny model): a seeded grammar-constrained request detached after k tokens and
    resumed (matcher replayed through the generated tokens, RNG state carried) ends exactly as the
    uninterrupted run, for several k; the output stays in the grammar."""
    import json
    import re

    eng = engine(tiny_path)
    grammar = json.dumps({"grammars": [{"lark_grammar": 'start: /[a-e]{3,9}( [a-e]{3,9}){4,8}/'}]})
    sp = SamplingParams(max_tokens=60, temperature=0.9, seed=3, grammar=grammar)

    def drive(req: EngineRequest, stop_after: int | None = None) -> tuple[list[int], str]:
        eng.add_request(req)
        ids, text = [], ""
        while eng.has_request(req.request_id) and (stop_after is None or len(ids) < stop_after):
            for o in eng.step():
                ids, text = ids + list(o.new_token_ids), text + o.text
        return ids, text

    ref_ids, ref_text = drive(EngineRequest("ref", PROMPT, sp))
    assert re.fullmatch(r"[a-e]{3,9}( [a-e]{3,9}){4,8}", ref_text) and len(ref_ids) >= 8, ref_text
    for k in (2, len(ref_ids) // 2, len(ref_ids) - 2):
        head_ids, head_text = drive(EngineRequest(f"m{k}", PROMPT, sp), stop_after=k)
        output_ids, rng = eng.detach_request(f"m{k}")
        eng.reset_prefix_cache()  # another worker: nothing cached
        resumed = EngineRequest(f"m{k}", PROMPT, sp, resumed_output_ids=output_ids, rng_state=rng)
        tail_ids, tail_text = drive(resumed)
        assert head_ids + tail_ids == ref_ids and head_text + tail_text == ref_text, k
