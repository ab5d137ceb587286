"""``actorserve bench ...``: the benchmark verbs (bench/), each needing the ``bench`` extra (control/ops/extras.py).

The verbs' options come from each benchmark module's ``add_arguments``; their implementations are imported only
when the verb runs.
"""

from __future__ import annotations

import argparse
from typing import Any

def add_bench_commands(sub: Any) -> None:
    """``actorserve bench engine | fairness | prefix-routing | structured``."""
    bench = sub.add_parser("bench", help="benchmarks (engine, fairness, prefix-routing, structured)")
    bench.set_defaults(extras=("bench",))  # transformers, httpx: control/ops/extras.py
    bsub = bench.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)
    be = bsub.add_parser(
        "engine", help="offline engine benchmark against transformers (table + JSON)",
        description="Measure decode/prefill tokens/s, matmul roofline and prefix-cache speedup of the "
        "engine on the default model, against transformers generate (needs actorserve[bench]).",
    )
    from bench.engine_bench import add_arguments as _engine_arguments
    _engine_arguments(be)
    be.set_defaults(func=_cmd_bench_engine)
    bf = bsub.add_parser(
        "fairness", help="latency isolation (B solo / fair / batch flood / FCFS), 3:1 and 1:2:3 token shares, "
                         "10x overload goodput (table + JSON)",
        description="Starts its own stack (default model) and its tenants; see bench/fairness_bench.py and "
                    "docs/bench.md.",
    )
    from bench.fairness_bench import add_arguments as _fairness_arguments
    _fairness_arguments(bf)
    bf.set_defaults(func=_cmd_bench_fairness)
    bp = bsub.add_parser(
        "prefix-routing", help="prefix-cache hit rate: affinity routing vs random routing (2 workers)",
        description="Starts a 2-worker stack per routing policy; see bench/prefix_routing_bench.py.",
    )
    from bench.prefix_routing_bench import add_arguments as _prefix_arguments
    _prefix_arguments(bp)
    bp.set_defaults(func=_cmd_bench_prefix_routing)
    bs = bsub.add_parser(
        "structured", help="engine tok/s with half the sequences JSON-schema constrained vs none (table + JSON)",
        description="Offline engine bench on the default model; see bench/structured_bench.py.",
    )
    from bench.structured_bench import add_arguments as _structured_arguments
    _structured_arguments(bs)
    bs.set_defaults(func=_cmd_bench_structured)
    bc = bsub.add_parser(  # [14] S2: the simulator's latency model against the live stack
        "sim-check", help="simulated vs measured TTFT / TPOT on this machine (starts a stack; target +-20 %%)",
        description="Starts a 1-worker stack, profiles this machine, runs Poisson loads; see bench/sim_check.py.",
    )
    from bench.sim_check import add_arguments as _sim_check_arguments, main as _sim_check_main
    _sim_check_arguments(bc)
    bc.set_defaults(func=_sim_check_main, extras=("bench", "sim"))  # the simulator's latency model: scipy
    bpl = bsub.add_parser(  # issue 15 item 6: docs/bench.md, decision 0029
        "platform", help="what the platform costs: CPU per request / per token, req/s (zero-compute worker)",
        description="Starts `up` with a zero-compute worker; see bench/platform_bench.py and docs/bench.md.",
    )
    from bench.platform_bench import add_arguments as _platform_arguments, main as _platform_main
    _platform_arguments(bpl)
    bpl.set_defaults(func=_platform_main)
    bsv = bsub.add_parser(  # issue 15 item 4: docs/bench.md
        "serve", help="the whole platform vs llama.cpp's llama-server (or --peer-url): tok/s, TTFT, ITL at "
                      "1-64 streams (table + JSON + PNG)",
        description="Starts `up` (as make run), then the peer on the same GGUF; see bench/serve_bench.py.",
    )
    from bench.serve_bench import add_arguments as _serve_arguments, main as _serve_main
    _serve_arguments(bsv)
    bsv.set_defaults(func=_serve_main, extras=("bench", "sim"))  # the PNG report: matplotlib


def _cmd_bench_structured(args: argparse.Namespace) -> int:
    from bench.structured_bench import main_bench_structured

    return main_bench_structured(args)


def _cmd_bench_prefix_routing(args: argparse.Namespace) -> int:
    from bench.prefix_routing_bench import main as prefix_main

    return prefix_main(args)


def _cmd_bench_fairness(args: argparse.Namespace) -> int:
    from bench.fairness_bench import main as fairness_main

    return fairness_main(args)


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    from bench.engine_bench import main_bench_engine

    return main_bench_engine(args)
