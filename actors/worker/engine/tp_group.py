"""A tensor-parallel group of one worker: rank 0 is the worker's engine, ranks 1..N-1 are follower processes.

Rank 0 starts the followers (``python -m actors.worker.tp_rank``, children that die with it:
actors/lifeline.py), and every rank joins one ``torch.distributed`` process group (gloo on CPU, NCCL on
CUDA) over a TCP rendezvous on 127.0.0.1. Each rank builds its shard of the model (tensor_parallel.py) and its
part of the KV cache: the same number of blocks on every rank (the least any rank can hold), its own KV heads.
Rank 0 alone schedules, samples and talks to NATS: before each forward pass it broadcasts the step's packed
inputs (token ids, positions, KV slots, block tables) and every rank runs the same forward, meeting at the two
all-reduces per layer. So the group registers and takes credits as one logical worker.

Losing a rank: a watchdog thread on rank 0 polls the followers (every 0.2 s) and a failed collective raises;
either marks the group lost, calls ``on_lost`` (the worker actor exits, so its lease lapses and the scheduler
retries its requests that had no token yet elsewhere) and makes every later forward raise ``TPGroupLost``.
Followers exit when rank 0 goes (their broadcast fails, or the parent-death signal).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 120.0  # rendezvous and every collective: followers load the model meanwhile
POLL_S = 0.2  # watchdog period (s)


class TPGroupLost(RuntimeError):
    """A rank of the tensor-parallel group is gone (exited, or a collective failed): the group cannot serve."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """This process's membership of the group. ``rank``, ``world``; on rank 0 ``procs`` (the followers)."""

    def __init__(self, rank: int, world: int, init_method: str, device: str) -> None:
        self.rank, self.world, self.init_method = rank, world, init_method
        self.procs: list = []
        self.lost: str | None = None  # why the group is lost (rank 0), None while whole
        self.on_lost: Callable[[str], None] | None = None  # rank 0: called once, from the watchdog or a step
        self.rank_bytes: list[dict] = []  # per rank {"rank", "weights_bytes", "kv_bytes"} (after ``describe``)
        self._backend = "nccl" if str(device).startswith("cuda") else "gloo"
        self._stop = threading.Event()

    @classmethod
    def open(cls, config, dtype_name: str, quantization: str | None) -> "TPGroup":
        """Rank 0: start the followers with ``config`` (dtype and quantization resolved, so every rank builds the
        same kernels) and join; a follower (``config.tp_init`` set): join. RuntimeError when a rank does not
        join within JOIN_TIMEOUT_S."""
        if config.tp_rank:
            group = cls(config.tp_rank, config.tensor_parallel, config.tp_init, config.device)
        else:
            group = cls(0, config.tensor_parallel, f"tcp://127.0.0.1:{free_port()}", config.device)
            group._spawn(dataclasses.replace(config, dtype=dtype_name, quantization=quantization,
                                             tp_init=group.init_method, progress=False))
        group._join()
        return group

    def _spawn(self, config) -> None:
        from actors.lifeline import popen

        for rank in range(1, self.world):
            cfg = json.dumps(dataclasses.asdict(dataclasses.replace(config, tp_rank=rank)))
            self.procs.append(popen([sys.executable, "-m", "actors.worker.tp_rank", cfg]))
        log.info("tensor parallel: started ranks 1..%d (pids %s) on %s", self.world - 1,
                 [p.pid for p in self.procs], self.init_method)

    def _join(self) -> None:
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel group is already open in this process (one engine per process)")
        dist.init_process_group(self._backend, init_method=self.init_method, rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=JOIN_TIMEOUT_S))
        if self.rank == 0:
            threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    def agree_min(self, value: int) -> int:
        """The least ``value`` over the ranks (KV blocks every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        self._collective(dist.all_reduce, t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def describe(self, weights_bytes: int, kv_bytes: int) -> list[dict]:
        """Gather every rank's weight and KV bytes (``rank_bytes``)."""
        out: list = [None] * self.world
        self._collective(dist.all_gather_object, out, {"rank": self.rank, "weights_bytes": int(weights_bytes),
                                                        "kv_bytes": int(kv_bytes)})
        self.rank_bytes = out
        return out

    def send_step(self, payload: tuple | None) -> None:
        """Rank 0: hand the followers the next forward pass's inputs (None: stop)."""
        self._collective(dist.broadcast_object_list, [payload], src=0)

    def recv_step(self) -> tuple | None:
        """Follower: the next forward pass's inputs from rank 0 (None: stop)."""
        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _collective(self, fn, *args, **kwargs):
        if self.lost:
            raise TPGroupLost(self.lost)
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            self._mark_lost(f"tensor-parallel collective failed: {e}")
            raise TPGroupLost(self.lost) from e

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            for rank, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    self._mark_lost(f"tensor-parallel rank {rank} (pid {p.pid}) exited with {p.returncode}")
                    return

    def _mark_lost(self, why: str) -> None:
        if self.lost is not None or self._stop.is_set():
            return
        self.lost = why
        log.error("%s: the group cannot serve", why)
        if self.on_lost is not None:
            self.on_lost(why)

    def close(self, timeout_s: float = 5.0) -> None:
        """Rank 0: stop the followers (a stop step, then SIGKILL after ``timeout_s``) and leave the group."""
        self._stop.set()
        if self.rank == 0 and not self.lost:
            try:
                dist.broadcast_object_list([None], src=0)
            except RuntimeError:
                pass
        t_end = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.1, t_end - time.monotonic()))
            except Exception:
                p.kill()
                p.wait(5)
        if dist.is_initialized():
            dist.destroy_process_group()


class LeaderModel:
    """Rank 0's model: broadcasts each forward pass's inputs to the followers, then runs its own shard.
    Every other attribute is the wrapped ``LlamaModel``'s."""

    def __init__(self, model, group: TPGroup) -> None:
        self.model, self.group = model, group

    def forward(self, input_ids: torch.Tensor, meta, kv_cache: torch.Tensor) -> torch.Tensor:
        """As ``LlamaModel.forward``; TPGroupLost when a rank is gone."""
        self.group.send_step(step_payload(input_ids, meta))
        return self.group._collective(self.model.forward, input_ids, meta, kv_cache)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


_META_FIELDS = ("positions", "slot_mapping", "context_slots", "query_lens", "context_lens", "logits_indices",
                "block_tables")


def step_payload(input_ids: torch.Tensor, meta) -> tuple:
    """What a follower needs to run the same forward pass: ids and the metadata fields (CPU tensors)."""
    cpu = lambda v: v.cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return (input_ids.cpu(), {f: cpu(getattr(meta, f)) for f in _META_FIELDS})


def follow(engine) -> None:
    """Follower loop: run every forward pass rank 0 announces on this rank's shard, until told to stop."""
    from .model import BatchMetadata

    device = engine.config.device
    while (step := engine.tp.recv_step()) is not None:
        ids, fields = step
        to = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        meta = BatchMetadata(**{k: to(v) for k, v in fields.items()})
        engine.model.forward(ids.to(device), meta, engine.kv.tensor)
