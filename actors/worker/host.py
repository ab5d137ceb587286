"""A multi-version worker host: ``actorserve actor worker --host`` (issue [11] item 1; docs/model-loading.md).

One worker process holds several model versions within one memory budget (``--memory-budget-bytes``, else
80 % of the machine's memory): each resident version is a worker of its version (its own engine, KV cache,
dispatch subject, credits and etcd lease, actors/worker/host_slot.py); the residency policy
(actors/worker/residency.py, pure) decides every ``tick_s`` what to load, drain and evict from the demand it
sees:

* asks: a version's scheduler with queued requests and no live worker asks the host with the most free
  memory (``as.int.host.<host_id>.load``, HostLoad; actors/scheduler/host_ask.py); an ask counts its
  ``queue_len`` as demand for ``ask_ttl_s``;
* resident versions: tokens generated per second over the last ``RATE_WINDOW_S`` s and the sequences held.

Versions whose artifact, dtype and quantization are equal share one copy of the weights (the second engine is
built over the first's model). The KV bytes the weights leave are split by the policy (a floor per version,
the rest by demand); a version whose KV cache is larger than its new share is paused (no admissions) until
idle and resized, so a newcomer gets room. A version is evicted only when nothing runs on it (drained first;
forced after ``drain_bound_s``). The host's record ``/actorserve/hosts/{host_id}`` (leased) holds the budget,
free bytes, resident versions with their bytes, and the counts of loads and evictions; ``/metrics`` has
``actorserve_worker_resident_bytes{model, kind}``, ``actorserve_host_evictions_total`` and
``actorserve_host_loads_total``. A resident version told to sleep on its ``sleep_key`` frees its KV cache and
lends the room to the other versions; its wake takes the room back (actors/worker/host_sleep.py, issue [28]).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from actors.worker.host_measured import load_measured, save_measured
from actors.worker.host_sleep import HostSleep
from actors.worker.host_slot import Slot, close_slot, open_slot, pause, resume
from actors.worker.residency import Demand, ResidencyConfig, ResidencyPolicy, VersionSpec
from bus import subjects
from bus.host_messages import HostLoad, HostLoadAck

log = logging.getLogger("actorserve.worker")

RATE_WINDOW_S = 5.0  # tokens/s of a resident version: generated tokens over this window


def machine_budget_bytes(fraction: float = 0.8) -> int:
    """``fraction`` of the machine's physical memory (bytes; ``os.sysconf``), the budget without
    ``--memory-budget-bytes``."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * fraction)


class ModelHost:
    """The host's state and loop (module docstring). ``preload``: refs asked for at start (``--model``);
    ``pinned``: refs always resident (``--pin``). Budget in bytes."""

    def __init__(self, reg, bus, host_id: str, args: argparse.Namespace, budget_bytes: int,
                 preload: tuple[str, ...] = (), pinned: tuple[str, ...] = (), tick_s: float = 0.25,
                 ask_ttl_s: float = 3.0, refresh_s: float = 1.0) -> None:
        self.reg, self.bus, self.host_id, self.args = reg, bus, host_id, args
        self.budget, self.pinned, self.tick_s, self.ask_ttl_s = int(budget_bytes), set(pinned), tick_s, ask_ttl_s
        self.preload, self.refresh_s, self._refreshed = tuple(preload) + tuple(pinned), refresh_s, 0.0
        self.policy = ResidencyPolicy(ResidencyConfig(drain_bound_s=getattr(args, "drain_bound", 30.0)))
        self.slots: dict[str, Slot] = {}
        self.manifests: dict[str, dict] = {}
        self.asks: dict[str, tuple[int, float]] = {}  # ref -> (queue_len, monotonic s of the ask)
        self.rates: dict[str, list[tuple[float, int]]] = {}  # ref -> [(monotonic s, tokens generated)]
        self.last_used: dict[str, float] = {}
        self.measured = load_measured()  # share key -> (weights bytes, load s) seen on this machine
        self.extra_seen: dict[str, int] = {}  # share key -> LoRA slot bytes of an engine of it
        self._waits_logged: dict[str, float] = {}  # ref -> monotonic s of its last "waits for room" line
        self.num_loads = self.num_evictions = self.num_failed_loads = 0
        self.num_forced = 0  # evictions that ended running requests (the drain bound passed)
        self.engine_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self.sleep = HostSleep(self)  # versions told to sleep lend their KV bytes (actors/worker/host_sleep.py)
        self.wake = asyncio.Event()
        self._n = 0
        self._lease = None
        self._sub = None
        self._written: dict = {}  # the last record written (without ts and running counts)
        self._written_at = 0.0

    # ---- names and specs ---------------------------------------------------------------------
    def next_worker_id(self) -> str:
        """``<host id>-v<n>``: the worker id of the next resident version (unique in this process)."""
        self._n += 1
        return f"{self.host_id}-v{self._n}"

    def share_key(self, manifest: dict) -> str:
        """Versions with equal keys share one copy of the weights: artifact, dtype flag and quantization (the
        worker's pin, else the manifest's)."""
        quant = self.args.quantization if self.args.quantization != "auto" else manifest.get("quantization") or "auto"
        return f"{manifest['artifact']}|{self.args.dtype}|{quant}"

    def spec(self, ref: str) -> VersionSpec:
        """The policy's view of ``ref``: weights measured on this machine for its share key (host_measured.py),
        else the manifest's ``memory_bytes`` (else the artifact's size); KV floor ``--kv-floor-bytes`` plus its
        LoRA slots; load cost measured, else 5 s (0.1 s when a resident version shares its weights)."""
        m = self.manifests[ref]
        key = self.share_key(m)
        weights, load_s = self.measured.get(key, (0, 5.0))
        if not weights:
            weights = int(m.get("memory_bytes") or _file_size(m.get("artifact", "")))
        if any(s.share_key == key for s in self.slots.values()):
            load_s = 0.1
        floor = self.args.kv_floor_bytes + self.extra_bytes(ref, key)  # the policy's per-version bytes beside weights
        if ref in self.slots and self.sleep.asleep(self.slots[ref]):
            floor = self.extra_bytes(ref, key)  # asleep: no KV cache; its room is lent (host_sleep.py)
        return VersionSpec(ref, weights, key, kv_floor_bytes=floor, pinned=ref in self.pinned,
                           slo_class=str(m.get("slo_class", "interactive")), load_cost_s=load_s)

    def extra_bytes(self, ref: str, key: str) -> int:
        """Bytes a version holds beside its weights and KV cache (its engine's LoRA slots): measured when it is
        resident, else as seen for its share key, else the most any resident version holds."""
        if ref in self.slots:
            return self.slots[ref].extra_bytes
        return self.extra_seen.get(key, max((s.extra_bytes for s in self.slots.values()), default=0))

    def demand(self, ref: str, now: float) -> Demand:
        """Asks younger than ``ask_ttl_s`` and, for a resident version, its recent tokens/s and sequences."""
        queue, t_ask = self.asks.get(ref, (0, 0.0))
        queue = queue if now - t_ask <= self.ask_ttl_s else 0
        slot = self.slots.get(ref)
        if slot is None:
            return Demand(queue_len=queue, last_used=max(t_ask, self.last_used.get(ref, 0.0)))
        samples = self.rates.setdefault(ref, [])
        total = int(slot.engine.stats().num_generated_tokens) if slot.engine is not None else 0
        samples.append((now, total))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.pop(0)
        rate = (total - samples[0][1]) / max(1.0, now - samples[0][0])  # >= 1 s: one short burst is no rate
        running = len(slot.svc.live) + slot.svc.num_queued
        if running or total != slot.generated:
            self.last_used[ref] = now
        slot.generated = total
        return Demand(max(0.0, rate), queue, running, self.last_used.get(ref, t_ask))

    # ---- asks ----------------------------------------------------------------------------------
    async def on_load(self, msg) -> None:
        """HostLoad request: record the ask (demand) and answer at once; the loop loads when the policy says."""
        try:
            ask = HostLoad.decode(msg.data)
            ref = f"{ask.name}@{ask.version}"
            ack = await self.ask(ref, ask.queue_len)
        except ValueError as exc:
            ack = HostLoadAck(False, f"bad load request: {exc}", self.free_bytes())
        if msg.reply:
            await msg.respond(ack.encode())

    async def ask(self, ref: str, queue_len: int) -> HostLoadAck:
        """Note demand for ``ref``; refuse an unregistered version or one that cannot fit this budget alone."""
        if ref not in self.manifests:
            name, _, version = ref.partition("@")
            manifest = await self.reg.get_model_version(name, version)
            if manifest is None or manifest.get("status", "active") != "active":
                return HostLoadAck(False, f"{ref} is not an active registered version", self.free_bytes())
            self.manifests[ref] = manifest
        spec = self.spec(ref)
        if spec.weights_bytes + spec.kv_floor_bytes > self.budget:
            return HostLoadAck(False, f"{ref} needs {spec.weights_bytes + spec.kv_floor_bytes} bytes; this host's "
                               f"budget is {self.budget}", self.free_bytes())
        self.asks[ref] = (max(1, queue_len), time.monotonic())
        log.debug("host %s: asked for %s (%d queued)", self.host_id, ref, queue_len)
        self.wake.set()
        state = "resident" if ref in self.slots else "queued for loading"
        return HostLoadAck(True, state, self.free_bytes())

    # ---- bytes ---------------------------------------------------------------------------------
    def held_bytes(self) -> int:
        """Bytes the resident versions hold: weights once per share key, each KV cache and LoRA slots."""
        weights = {s.share_key: s.weights_bytes for s in self.slots.values()}
        return sum(weights.values()) + sum(s.kv_bytes + s.extra_bytes for s in self.slots.values())

    def free_bytes(self) -> int:
        return max(0, self.budget - self.held_bytes())

    def kv_cap(self) -> int:
        """The most KV cache one version gets (bytes): ``--kv-cache-bytes`` (at least the floor). A large budget
        is room for more versions, not a multi-GiB cache for the first one."""
        return max(int(self.args.kv_cache_bytes), int(self.args.kv_floor_bytes))

    # ---- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Plan and carry out residency every ``tick_s`` (sooner after an ask) until cancelled."""
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad round must not stop the host; logged, tried again
                log.exception("host %s: residency round failed", self.host_id)
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.tick_s)

    async def tick(self) -> None:
        """One round: versions retired from the registry go, then the plan, and the evictions, resizes and
        loads it asks for."""
        now = time.monotonic()
        if now - self._refreshed >= self.refresh_s:
            await self._drop_retired()
            self._refreshed = now
        refs = set(self.manifests) & ({r for r, (_, t) in self.asks.items() if now - t <= self.ask_ttl_s}
                                      | set(self.slots) | self.pinned)
        specs = {r: self.spec(r) for r in refs}
        demand = {r: self.demand(r, now) for r in refs}
        await self.sleep.wake_round(demand)
        specs = {r: self.spec(r) for r in refs}  # a version woken or put to sleep above counts its KV floor or not
        plan = self.policy.plan(self.budget, specs, demand, set(self.slots), now, asleep=self.sleep.asleep_refs())
        if plan.load or plan.evict or plan.drain:
            log.debug("host %s: plan %s; demand %s", self.host_id, plan.reasons, demand)
        for ref in plan.drain:
            if not self.slots[ref].svc.draining:
                log.info("host %s: %s", self.host_id, plan.reasons[ref])
                await pause(self.slots[ref])
        for ref in plan.evict:
            await self._evict(ref, ref in plan.forced, plan.reasons[ref])
        for ref, slot in self.slots.items():  # a drain called off (wanted again); not one whose eviction waits
            if slot.svc.draining and not slot.resize_to and ref not in plan.drain and ref not in plan.evict \
                    and not self.sleep.held(ref):
                await resume(slot)
        await self._resize(plan.kv_bytes)
        for ref in plan.load:
            await self._load(ref, plan.kv_bytes, specs, demand, now)
        await self.publish_record()

    async def _drop_retired(self) -> None:
        """Forget versions no longer active in the registry (retired, deleted or changed): a resident one is
        closed (its running requests get the drain bound; its bytes are free after)."""
        try:
            async with asyncio.timeout(2.0):
                models = await self.reg.list_models()  # one read for every version this host knows
        except Exception:  # etcd slow: keep what we know
            return
        for ref in list(self.manifests):
            name, _, version = ref.partition("@")
            manifest = models.get(name, {}).get(version)
            if manifest is not None and manifest.get("status", "active") == "active" \
                    and manifest.get("artifact") == self.manifests[ref].get("artifact"):
                continue
            del self.manifests[ref]
            self.asks.pop(ref, None)
            self.pinned.discard(ref)
            if (slot := self.slots.pop(ref, None)) is not None:
                log.info("host %s: %s left the registry's active versions; closing it", self.host_id, ref)
                await close_slot(slot, False, self.policy.cfg.drain_bound_s)
                self.num_evictions += 1

    async def _evict(self, ref: str, forced: bool, why: str) -> None:
        slot = self.slots[ref]
        if not forced and not slot.idle():  # a dispatch raced the plan: evict at a later round
            await pause(slot)
            return
        log.info("host %s: evicting %s (%s)", self.host_id, ref, why)
        del self.slots[ref]
        self.rates.pop(ref, None)
        await close_slot(slot, forced)
        self.num_evictions += 1
        self.num_forced += int(forced)

    async def _resize(self, shares: dict[str, int], slack: float = 1.1) -> None:
        """Versions whose KV cache is over their share (less their LoRA slots) by more than ``slack``: pause, and
        resize once idle; a paused version with its new size admits again."""
        for ref, slot in self.slots.items():
            if self.sleep.asleep(slot):  # no KV cache to resize; a wake sizes it (host_sleep.py)
                continue
            target = min(shares.get(ref, 0) - slot.extra_bytes, self.kv_cap())
            if target >= self.args.kv_floor_bytes and slot.kv_bytes > target * slack and not slot.resize_to:
                slot.resize_to = target
                await pause(slot)
            if slot.resize_to and slot.idle():
                await slot.svc.run_on_engine_thread(slot.engine.resize_kv, slot.resize_to)
                log.info("host %s: %s KV cache resized to %d bytes", self.host_id, ref, slot.kv_bytes)
                slot.resize_to = 0
                await resume(slot)

    async def _load(self, ref: str, shares: dict[str, int], specs: dict[str, VersionSpec], demand: dict,
                    now: float) -> None:
        """Load ``ref`` with a KV cache of its share less its LoRA slots (at most what is free beside its weights).
        Short of room: every version over its share is paused for a resize (the room comes when they are idle);
        when nothing is pausing or draining, the plan's figures were wrong (a first load estimated from the
        manifest) and the least valuable idle version is evicted to make room."""
        spec, kv_share = specs[ref], shares.get(ref, specs[ref].kv_floor_bytes)
        donor = next((s for s in self.slots.values() if s.share_key == spec.share_key), None)  # any holder
        extra = self.extra_bytes(ref, spec.share_key)
        weights = (0 if donor else spec.weights_bytes) + extra
        kv = min(kv_share - extra, self.free_bytes() - weights, self.kv_cap())
        if kv < self.args.kv_floor_bytes:
            await self._make_room(ref, shares, weights, specs, demand, now)
            return
        t0 = time.monotonic()
        try:
            slot = await open_slot(self, ref, self.manifests[ref], kv, donor)
        except Exception as exc:
            self.num_failed_loads += 1
            self.asks.pop(ref, None)
            log.error("host %s: loading %s failed: %r", self.host_id, ref, exc)
            return
        self.slots[ref] = slot
        self.sleep.follow(slot)
        self.extra_seen[spec.share_key] = slot.extra_bytes
        self.rates[ref] = [(time.monotonic(), 0)]  # its tokens/s counts from here
        self.asks.pop(ref, None)  # served now: its demand is what it serves (its scheduler asks again if paused)
        self.num_loads += 1
        if not slot.shared:
            self.measured[spec.share_key] = (slot.weights_bytes, time.monotonic() - t0)
            await asyncio.to_thread(save_measured, dict(self.measured))
        over = self.held_bytes() - self.budget  # e.g. its LoRA slots, not known before the engine existed
        if over > 0 and slot.idle() and slot.kv_bytes - over >= self.args.kv_floor_bytes:
            await slot.svc.run_on_engine_thread(slot.engine.resize_kv, slot.kv_bytes - over)
        if self.held_bytes() > self.budget:
            log.warning("host %s: %s holds %d bytes, over the budget of %d (its weights were estimated at %d)",
                        self.host_id, ref, self.held_bytes(), self.budget, spec.weights_bytes)

    async def _make_room(self, ref: str, shares: dict[str, int], weights: int, specs: dict, demand: dict,
                         now: float) -> None:
        """``ref`` is wanted but short of room (see ``_load``); said in the log at most every 5 s."""
        await self._resize(shares, slack=1.0)
        pending = any(s.resize_to or s.svc.draining for s in self.slots.values())
        idle = [r for r, s in self.slots.items() if s.idle() and r not in self.pinned and not s.resize_to
                and s.share_key != specs[ref].share_key]  # never the holder of the weights it would share
        if not pending and idle:
            victim = min(idle, key=lambda r: (self.policy.score(specs[r], demand[r], True), demand[r].last_used))
            await self._evict(victim, False, f"evicted: making room for {ref} (the plan's estimates were short)")
        if now - self._waits_logged.get(ref, 0.0) >= 5.0:
            self._waits_logged[ref] = now
            log.info("host %s: %s waits for room: needs %d bytes beside %d free (%s)", self.host_id, ref,
                     weights + self.args.kv_floor_bytes, self.free_bytes(),
                     "versions pausing for a resize" if pending else "nothing to evict" if not idle else "evicting")

    # ---- record and metrics ------------------------------------------------------------------
    def record(self) -> dict:
        """The host's etcd record (module docstring)."""
        return {"host_id": self.host_id, "pid": os.getpid(), "budget_bytes": self.budget,
                "free_bytes": self.free_bytes(), "held_bytes": self.held_bytes(),
                "resident": [s.row() for s in self.slots.values()],
                "asked": sorted(r for r, (_, t) in self.asks.items() if time.monotonic() - t <= self.ask_ttl_s
                                and r not in self.slots),
                "loads": self.num_loads, "evictions": self.num_evictions, "forced_evictions": self.num_forced,
                "failed_loads": self.num_failed_loads, **self.sleep.record(),
                "ts": time.time()}

    async def publish_record(self, every_s: float = 5.0) -> None:
        """Write the record under the host's lease (taken on first use; a lost lease is taken again) when what it
        says changed (running counts aside), else every ``every_s``: residency is etcd state, load is not."""
        from control.state.names import host_key

        record = self.record()
        same = {k: v for k, v in record.items() if k != "ts"}
        same["resident"] = [{k: v for k, v in r.items() if k != "running"} for r in record["resident"]]
        now = time.monotonic()
        if same == self._written and now - self._written_at < every_s and self._lease is not None \
                and not self._lease.lost.is_set():
            return
        try:
            async with asyncio.timeout(3.0):
                if self._lease is None or self._lease.lost.is_set():
                    self._lease = await self.reg.put_leased(host_key(self.host_id), record,
                                                            ttl=self.args.lease_ttl)
                else:
                    await self.reg.put_json(self._lease.key, record, lease=self._lease.lease_id)
            self._written, self._written_at = same, now
        except Exception as exc:  # etcd slow or away: the next round writes again
            log.debug("host record write failed: %r", exc)

    def track_metrics(self) -> None:
        """Resident bytes per version and kind, the budget, loads and evictions on this worker's /metrics."""
        from actors.metrics import observable_counter, observable_gauge

        observable_gauge("actorserve_worker_resident_bytes", "Bytes a resident model version holds on this worker, "
                         "by kind (weights, kv; docs/model-loading.md).", "By",
                         lambda: [(r[f"{k}_bytes"], {"model": r["model"], "kind": k})
                                  for r in [s.row() for s in list(self.slots.values())] for k in ("weights", "kv")])
        observable_gauge("actorserve_worker_memory_budget_bytes", "Bytes this worker may hold for weights and KV "
                         "caches together.", "By", lambda: [(self.budget, {})])
        observable_gauge("actorserve_worker_sleeping", "1 while a resident version sleeps (KV cache freed, weights "
                         "kept; actors/worker/host_sleep.py).", "1",
                         lambda: [(1 if self.sleep.asleep(s) else 0, {"model": s.ref}) for s in list(self.slots.values())])
        observable_counter("actorserve_host_handbacks", "Sleeps of a resident version that handed memory back to a "
                           "waking version.", "1", lambda: [(self.sleep.handbacks, {})])
        observable_counter("actorserve_host_evictions", "Model versions this host evicted.", "1",
                           lambda: [(self.num_evictions, {})])
        observable_counter("actorserve_host_loads", "Model versions this host loaded.", "1",
                           lambda: [(self.num_loads, {})])

    async def start(self) -> None:
        """Serve load asks; the pinned versions are asked for at once."""
        self._sub = await self.bus.subscribe(subjects.host_load(self.host_id), self.on_load)
        for ref in self.preload:
            ack = await self.ask(ref, 1)
            if not ack.accepted:
                raise SystemExit(f"--model {ref}: {ack.reason}")
        self.track_metrics()

    async def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Drain every resident version (bounded), drop the record's lease."""
        if self._sub is not None:
            await self._sub.unsubscribe()
        await asyncio.gather(*(close_slot(s, False, drain_timeout_s) for s in self.slots.values()),
                             return_exceptions=True)
        self.slots.clear()
        if self._lease is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(3.0):
                    await self._lease.revoke()
        self.engine_thread.shutdown(wait=False)


def _file_size(path: str) -> int:
    """Bytes of the artifact: a GGUF file, or a Hugging Face directory's config and safetensors (0 if unreadable)."""
    from actors.worker.engine.hf_loader import artifact_bytes

    return artifact_bytes(path)
