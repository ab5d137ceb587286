"""The fleet simulator's engine: a fluid (aggregate) model stepped every ``tick_s`` (pure: simulated time).

Per tick, in order (figures per pool are arrays over the pool keys, per prompt bin over K bins):

1. cold starts end, leaving replicas past their deadline go, migrations past theirs are dropped (fleet.py);
2. spot preemptions (independent and the correlated event) give notices: those replicas stop taking work
   and their in-flight sequences join the migration queue;
3. arrivals (trace) join the scheduler's queue, split over the prompt bins by mass (one queue per model
   version, as the live scheduler holds it);
4. decoding: a pool of r ready replicas with N in-flight runs batch b = N / r; it generates
   r x tokens_per_s(b) tokens/s (the type's curve) and completes that / mean output tokens requests/s;
5. admission into free KV slots (r x max_batch - N): migrations first (any pool), then the bins — first
   pass each pool (the most restricted type first) takes only the bins whose prefill it serves within 80 %
   of the TTFT SLO (latency.eligible), the second pass lets any free slot take any bin;
6. latency of this tick's arrivals per bin and pool: queue wait W = queued / admission rate (0 when the
   queue emptied, infinite when nothing was admitted), plus the CPU tiers' mean sojourn, plus prefill(P);
   TPOT = ITL at the pool's batch after admission. The share within the SLO (TTFT <= SLO and TPOT <= SLO)
   is the bin's lognormal mass with prefill(P) <= SLO - W - CPU (latency.py), x [ITL <= TPOT SLO], weighted
   by where the bin was admitted this tick;
7. cost: every replica that exists (starting and leaving too) x its market's price x dt; CPU tiers apart;
8. every ``decide_every_s``: the policy gets a FleetView and returns desired replicas per pool; increases
   start replicas (ready after the type's cold start, within the fleet's accelerator cap), decreases cancel
   starting ones first, then drain ready ones (their sequences migrate); the CPU tiers' live policy runs too.

Conservation: arrived = completed + in flight + queued + migrating + dropped (``PolicyResult.requests``).
"""

from __future__ import annotations

import numpy as np

from control.sim.api import FleetInputs, FleetPolicy, FleetView, PolicyResult, PoolView, Trace, split_pool_key
from control.sim.cpu_tier import CpuTiers
from control.sim.fleet import FleetState, Preemptions
from control.sim.latency import CurveTable, eligible, prompt_bins
from control.sim.report import MinuteLog, finish_result


class _Pools:
    """Per-pool constants, indexed like inputs.pool_keys()."""

    def __init__(self, inputs: FleetInputs, bins) -> None:
        self.keys = inputs.pool_keys()
        self.types = [split_pool_key(k)[0] for k in self.keys]
        self.markets = [split_pool_key(k)[1] for k in self.keys]
        acc = [inputs.types[t] for t in self.types]
        self.accel = acc
        self.price = np.array([a.price_per_h(m) for a, m in zip(acc, self.markets)])
        self.gpus = np.array([a.gpus_per_replica for a in acc])
        self.slots = np.array([float(a.max_batch) for a in acc])
        self.cold = np.array([a.cold_start_s for a in acc])
        tables = {t: CurveTable(a.curve) for t, a in inputs.types.items()}
        self.tables = [tables[t] for t in self.types]
        self.type_names = list(inputs.types)
        self.type_tables = tables
        self.type_index = np.array([self.type_names.index(t) for t in self.types])
        el = eligible(inputs, bins)
        self.bin_prefill = np.stack([t.ttft_ms(bins.mean) for t in self.tables])
        self.elig = np.array([el[t] for t in self.types], dtype=float)
        slo_b = {t: a.curve.max_batch_at(inputs.slo.itl_ms) for t, a in inputs.types.items()}
        self.slo_slots = np.array([min(max(slo_b[t], 1.0), a.max_batch) for t, a in zip(self.types, acc)])
        order = sorted(inputs.types, key=lambda t: (el[t].sum(), t))
        self.groups = [(np.array([p for p, tt in enumerate(self.types) if tt == t]), el[t].astype(float))
                       for t in order]


def _admit(q: np.ndarray, nf: np.ndarray, ready: np.ndarray, pools: "_Pools") -> np.ndarray:
    """Admit queued requests per bin (step 5); returns admitted (P, K); ``q`` changes in place.

    Four passes: (eligible bins, up to the batch meeting the ITL SLO), (any bin, same), (eligible bins, up to
    the KV slots), (any bin, same): a pool is filled past its SLO batch only when no pool has room within
    it. In a pass the types go most restricted first; a type's pools (both markets) share its bins in
    proportion to their room, each bin in proportion to what it has queued."""
    adm = np.zeros((len(nf), len(q)))
    used = nf.copy()
    for limit, any_bin in ((pools.slo_slots, False), (pools.slo_slots, True), (pools.slots, False),
                           (pools.slots, True)):
        room_all = np.maximum(ready * limit - used, 0.0)
        for members, mask in pools.groups:
            room = room_all[members]
            r = room.sum()
            if r <= 1e-9:
                continue
            d = q if any_bin else q * mask
            tot = d.sum()
            if tot <= 1e-12:
                continue
            take = min(r, tot)
            x = d * (take / tot)
            split = room / r
            adm[members] += split[:, None] * x[None, :]
            used[members] += split * take
            q -= x
        np.maximum(q, 0.0, out=q)
    return adm


def _migrate(state: FleetState, free: np.ndarray) -> np.ndarray:
    """Re-admit migrating sequences (oldest deadline first) into free slots of any pool, in proportion."""
    got = np.zeros(len(free))
    for m in sorted(state.migrations, key=lambda m: m.deadline_s):
        room = free.sum()
        if room <= 1e-9:
            break
        take = min(m.n, room)
        x = free * (take / room)
        got += x
        free -= x
        m.n -= take
    return got


def _ttft_p90(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per row (pool): the weighted 90th percentile of ``values`` (P, K) under ``weights`` (P, K); 0 for a
    row without weight; at most 1e7 ms."""
    idx = np.argsort(values, axis=1)
    v = np.take_along_axis(values, idx, axis=1)
    w = np.take_along_axis(weights, idx, axis=1)
    tot = w.sum(axis=1)
    cw = np.cumsum(w, axis=1) / np.where(tot > 0, tot, 1.0)[:, None]
    j = np.argmax(cw >= 0.9 - 1e-12, axis=1)
    out = v[np.arange(len(v)), j]
    return np.where(tot > 0, np.minimum(out, 1e7), 0.0)


def _apply(desired, now: float, state: FleetState, pools: _Pools, inputs: FleetInputs) -> None:
    """Start / stop replicas toward ``desired`` (step 8)."""
    starting = state.counts(state.starting)
    for key, want in desired.items():
        p = pools.keys.index(key)
        want = max(0, min(int(want), inputs.max_replicas_per_pool))
        cur = int(state.ready[p] + starting[p])
        if want > cur:
            room = (inputs.max_accelerators - state.total_accelerators(pools.gpus)) // int(pools.gpus[p])
            state.start(p, max(0, min(want - cur, room)), now + pools.cold[p])
        elif want < cur:
            rest = (cur - want) - state.cancel_starting(p, cur - want)
            state.leave(p, rest, now, inputs.spot.notice_s, preempted=False)


def simulate(inputs: FleetInputs, trace: Trace, policy: FleetPolicy, *, tick_s: float | None = None,
             seed: int = 0) -> PolicyResult:
    """Run ``policy`` over ``trace`` (module docstring). ``tick_s`` must equal the trace's tick when given."""
    dt = trace.tick_s
    if tick_s is not None and abs(tick_s - dt) > 1e-9:
        raise ValueError(f"tick_s ({tick_s}) must equal the trace's tick ({dt}); make the trace with it")
    rng = np.random.default_rng(seed + 1)
    bins = prompt_bins(inputs.trace)
    pools = _Pools(inputs, bins)
    n_pools, k = len(pools.keys), bins.k
    state, pre, cpu = FleetState.empty(inputs), Preemptions(inputs, pools.keys, rng), CpuTiers(inputs.cpu_tier)
    q = np.zeros(k)
    share = np.zeros((n_pools, k))
    out_mean, slo = trace.output_mean, inputs.slo
    log = MinuteLog(pools.keys, dt)
    tot = {"arrived": 0.0, "met": 0.0, "completed": 0.0, "cost": 0.0}
    cpu_p99 = np.zeros(trace.n_ticks)
    every = max(1, int(round(inputs.decide_every_s / dt)))
    for i in range(trace.n_ticks):
        now = i * dt
        state.advance(now)
        notices = pre.draw(now, dt, state.ready)
        for p in np.nonzero(notices)[0]:
            state.leave(int(p), int(notices[p]), now, inputs.spot.notice_s, preempted=True)
        rps = float(trace.rps[i])
        if i == 0:  # warm start: the first decision, on an empty queue, is ready at once (every policy alike)
            view = _view(now, rps, out_mean, trace, q, state, pools, share, np.zeros(n_pools), np.zeros(n_pools),
                         0.0, bins, state.in_flight, inputs, np.zeros(k))
            _apply(policy.decide(view), now, state, pools, inputs)
            state.advance(float("inf"))
            cpu.warm(rps)
        a = rps * dt
        q += a * bins.mass
        tot["arrived"] += a
        ready = state.ready.astype(float)
        nf = state.in_flight
        batch = np.divide(nf, ready, out=np.zeros(n_pools), where=ready > 0)
        tps = np.array([t.tokens_per_s(b) for t, b in zip(pools.tables, batch)]) * ready
        comp = np.minimum(nf, tps * dt / out_mean)
        nf -= comp
        tot["completed"] += float(comp.sum())
        nf += _migrate(state, np.maximum(ready * pools.slots - nf, 0.0))
        adm = _admit(q, nf, ready, pools)
        nf += adm.sum(axis=1)
        adm_k = adm.sum(axis=0)
        wait = np.where(q > 1e-9, np.divide(q * dt * 1e3, adm_k, out=np.full(k, np.inf), where=adm_k > 0), 0.0)
        share = np.where(adm_k > 0, np.divide(adm, adm_k, out=np.zeros_like(adm), where=adm_k > 0), share)
        batch = np.divide(nf, ready, out=np.zeros(n_pools), where=ready > 0)
        itl = np.array([t.itl_ms(b) for t, b in zip(pools.tables, batch)])
        cpu_mean, cpu_p99[i] = cpu.step(now, dt, rps)
        budget = slo.ttft_ms - wait - cpu_mean
        pstar = np.stack([pools.type_tables[t].prompt_within(budget) for t in pools.type_names])
        frac = bins.frac_within(pstar[pools.type_index])
        met_k = (share * frac * (itl <= slo.itl_ms * (1 + 1e-9))[:, None]).sum(axis=0)  # ITL at the SLO batch is at the SLO: float noise must not miss it
        met = a * float((bins.mass * met_k).sum())
        tot["met"] += met
        billed = state.ready + state.counts(state.starting) + state.counts(state.leaving)
        cost = float((billed * pools.price).sum()) * dt / 3600.0
        tot["cost"] += cost
        log.add(now, a, met, cost, billed)
        if i % every == 0 and i > 0:
            view = _view(now, rps, out_mean, trace, q, state, pools, share, tps, itl, cpu_mean, bins, nf, inputs,
                         wait)
            _apply(policy.decide(view), now, state, pools, inputs)
            cpu.decide(now)
    requests = {"arrived": tot["arrived"], "completed": tot["completed"], "in_flight": float(state.in_flight.sum()),
                "queued": float(q.sum()), "migrating": state.migrating(), "dropped_by_preemption":
                state.dropped_preempted, "dropped_by_drain": state.dropped_drained, "met": tot["met"],
                "preemption_notices": state.preemptions}
    res = finish_result(policy.name, inputs, trace, tot, requests, cpu, cpu_p99, log, pools.keys)
    report = getattr(policy, "report", None)
    if callable(report):  # a policy's own figures (the live policy's forecast error), beside its decisions
        res.extra["policy"] = report()
    return res


def _view(now, rps, out_mean, trace, q, state, pools, share, tps, itl, cpu_mean, bins, nf, inputs, wait):
    starting, leaving = state.counts(state.starting), state.counts(state.leaving)
    views = {}
    ttft = _ttft_p90(np.minimum(wait, 1e7)[None, :] + cpu_mean + pools.bin_prefill, share * bins.mass)
    queue = (share * q).sum(axis=1) * out_mean
    for p, key in enumerate(pools.keys):
        cap = state.ready[p] * pools.slots[p]
        views[key] = PoolView(key, pools.accel[p], pools.markets[p], int(state.ready[p]), int(starting[p]),
                              int(leaving[p]), float(tps[p]), float(queue[p]), float(ttft[p]),
                              float(itl[p]) if state.ready[p] else 0.0,
                              float(nf[p] / cap) if cap > 0 else 0.0)
    return FleetView(now, rps, rps * out_mean, trace.prompt_mean, out_mean,
                     float((q.sum() + state.migrating()) * out_mean), views, inputs)
