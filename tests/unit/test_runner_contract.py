"""The runner interface's contract (actors/worker/engine/runner.py), one test body for every runner: the torch
runner (the tiny random GGUF, float32, CPU) and the zero-compute runner (its metadata only)."""

from __future__ import annotations

import pytest

from actors.worker.engine.block_manager import BlockManager
from actors.worker.engine.engine import EngineConfig
from actors.worker.engine.runner import RowSampling, RunnerInput, RunnerOutput, RunnerRow
from actors.worker.engine.types import SamplingParams
from actors.worker.zero_compute import ZeroComputeConfig, ZeroComputeRunner
from tests.engine_fixtures import write_tiny_llama_gguf

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama_gguf(str(tmp_path_factory.mktemp("tinyrc") / "tiny.gguf"))


def torch_runner(path):
    from actors.worker.engine.torch_runner import TorchRunner
    return TorchRunner(EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=2 * 2**20, block_size=BLOCK))


def zero_runner(path):
    return ZeroComputeRunner(ZeroComputeConfig(path, kv_cache_bytes=2 * 2**20, block_size=BLOCK))


@pytest.fixture(params=[torch_runner, zero_runner], ids=["torch", "zero-compute"])
def runner(request, tiny_path):
    return request.param(tiny_path)


class Seqs:
    """Sequences over a runner's KV blocks, fed as the engine feeds them (prefill, then one token a step)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, BLOCK, False)
        self.tokens: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}  # positions in the KV cache
        self.rngs: dict[str, object] = {}

    def add(self, sid: str, prompt: list[int], seed: int | None = 0) -> None:
        self.tokens[sid], self.outputs[sid], self.done[sid] = list(prompt), [], 0
        self.rngs[sid] = self.runner.new_rng(seed, None)

    def row(self, sid: str, n: int | None = None, params: SamplingParams = GREEDY) -> RunnerRow:
        toks, start = self.tokens[sid], self.done[sid]
        n = len(toks) - start if n is None else n
        if not self.blocks.has_seq(sid):
            self.blocks.allocate(sid, start + n)
        elif start + n > self.blocks.num_slots(sid):
            self.blocks.append_slots(sid, start + n - self.blocks.num_slots(sid))
        samples = start + n == len(toks)
        sampling = RowSampling(params, self.rngs[sid], self.outputs[sid], toks) if samples else None
        return RunnerRow(sid, toks[start:start + n], start, list(self.blocks.block_table(sid)), samples, None,
                         sampling)

    def run(self, rows: list[RunnerRow]) -> RunnerOutput:
        out = self.runner.execute(RunnerInput(rows, BLOCK))
        for row in rows:
            self.done[row.seq_id] += row.num_new_tokens
        for row, t in zip([r for r in rows if r.samples], out.sampled_ids):
            self.tokens[row.seq_id].append(t)
            self.outputs[row.seq_id].append(t)
        return out


def test_one_output_per_sampling_row_with_ids_in_vocab(runner):
    s = Seqs(runner)
    s.add("a", [1, 40, 50, 60, 70])
    s.add("b", [1, 41, 52, 63, 74, 85, 96, 107, 118, 129, 130, 131, 132, 133, 134, 135, 136, 137])
    s.add("c", [1, 2, 3])
    out = s.run([s.row("a"), s.row("b", 10), s.row("c")])  # b: a prefill chunk that does not reach the end
    assert isinstance(out, RunnerOutput)
    assert len(out.sampled_ids) == len(out.logprobs) == 2
    assert all(isinstance(t, int) and 0 <= t < runner.vocab_size for t in out.sampled_ids)
    assert out.logprobs == [None, None]  # not asked for


def test_prefill_then_decode(runner):
    s = Seqs(runner)
    s.add("a", [1, 40, 50, 60, 70, 80, 90])
    s.run([s.row("a", 4)])  # a chunk: no row samples
    for _ in range(3):
        out = s.run([s.row("a")])
        assert len(out.sampled_ids) == 1
    assert len(s.outputs["a"]) == 3 and s.done["a"] == 9


def test_greedy_is_deterministic_and_batch_independent(runner):
    prompt = [1, 45, 55, 65, 75, 85]
    alone = Seqs(runner)
    alone.add("x", prompt)
    for _ in range(4):
        alone.run([alone.row("x")])
    batched = Seqs(type(runner)(runner.config))
    batched.add("x", prompt, seed=None)
    batched.add("y", [1, 9, 8, 7])
    for _ in range(4):
        batched.run([batched.row("y"), batched.row("x")])
    assert alone.outputs["x"] == batched.outputs["x"]


def test_logprobs_when_asked(runner):
    s = Seqs(runner)
    s.add("a", [1, 40, 50, 60])
    s.add("b", [1, 41, 51])
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    out = s.run([s.row("a", params=params), s.row("b")])
    (token, lp, top), none = out.logprobs
    assert none is None and token == out.sampled_ids[0]
    assert isinstance(lp, float) and lp <= 0.0
    assert 1 <= len(top) <= 3 and all(0 <= i < runner.vocab_size and v <= 0.0 for i, v in top)
    assert top[0][1] >= lp - 1e-6  # the best entry is at least as likely as the chosen (greedy) one


def test_rng_state_round_trips(runner):
    rng = runner.new_rng(7, None)
    state = runner.rng_state(rng)
    assert isinstance(state, bytes)
    assert runner.rng_state(runner.new_rng(None, state)) == state


def test_zero_compute_sleeps_what_the_curve_says_a_step_of_its_shape_takes(tiny_path, monkeypatch):
    """``curve``: a step sleeps ``ThroughputCurve.step_ms_at(decode rows, prefill tokens)`` (issue [29] item 4):
    a lone prefill of 12 tokens, then a step of two decodes beside a 5-token prefill chunk."""
    from actors.worker import zero_compute
    from control.policy.curves import DecodePoint, PrefillPoint, ThroughputCurve

    curve = ThroughputCurve("local", 0.0, "test", (DecodePoint(1, 20.0, 50.0), DecodePoint(4, 40.0, 100.0)),
                            (PrefillPoint(10, 200.0), PrefillPoint(20, 300.0)))
    slept: list[float] = []
    monkeypatch.setattr(zero_compute.time, "sleep", slept.append)
    seqs = Seqs(ZeroComputeRunner(ZeroComputeConfig(tiny_path, kv_cache_bytes=2 * 2**20, block_size=BLOCK,
                                                    curve=curve)))
    seqs.add("a", list(range(3, 15)))
    seqs.add("b", list(range(3, 9)))
    seqs.run([seqs.row("a"), seqs.row("b")])  # two prompts: 18 prefill tokens
    seqs.add("c", list(range(3, 8)))
    rows = [seqs.row("a"), seqs.row("b"), seqs.row("c")]
    assert zero_compute.step_shape(RunnerInput(rows, BLOCK)) == (2, 5)
    seqs.run(rows)
    assert slept == pytest.approx([curve.ttft_ms_at(18) / 1e3, (curve.itl_ms_at(2) + curve.ttft_ms_at(5)) / 1e3])
    assert slept[0] == pytest.approx(0.28) and slept[1] == pytest.approx((50 + 50 / 3) / 1e3 + 0.15)
    with pytest.raises(ValueError, match="not both"):
        ZeroComputeConfig(tiny_path, step_ms=1.0, curve=curve)
