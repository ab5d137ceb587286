"""``actorserve adapters ...``: LoRA adapters in the registry (control/state/adapters.py; docs/lora.md).

    actorserve adapters register NAME --model MODEL@VERSION --path DIR [--tenant T ...]
    actorserve adapters list [--model MODEL] [--json]
    actorserve adapters retire NAME [--model MODEL]

``register`` checks the PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``) and that the
version is registered; workers of that version pick the record up within seconds and read the files on the
first request naming ``MODEL:NAME``. ``retire`` makes the adapter answer 404; workers drop it once no request
uses it. etcd is found like every other verb (``--etcd``, ``$ACTORSERVE_ETCD``, ``<state-dir>/endpoints.json``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from control.ops.argtypes import subcommand_adder
from control.ops.cli_errors import run_on_registry

DEFAULT_MAX_RANK = 16  # the worker's --max-lora-rank default (actors/worker/actor.py)


def add_adapters_commands(sub: Any) -> None:
    """Add the ``adapters`` verb and its subcommands to the CLI's subparsers ``sub``."""
    a = sub.add_parser("adapters", help="register, list and retire LoRA adapters (etcd; docs/lora.md)")
    s = a.add_subparsers(dest="adapters_command", metavar="SUBCOMMAND", required=True)

    cmd = subcommand_adder(s, run_on_registry)

    p = cmd("register", "register a PEFT LoRA adapter for one model version", _register)
    p.add_argument("name", help="adapter name ([a-z0-9][a-z0-9_-]*): requests name MODEL:NAME")
    p.add_argument("--model", required=True, metavar="MODEL@VERSION", help="the version the adapter was trained on")
    p.add_argument("--path", required=True, help="PEFT directory readable by the workers (made absolute)")
    p.add_argument("--tenant", action="append", default=[], metavar="T",
                   help="only this tenant may use it (repeatable; default: every tenant allowed on the model)")
    p = cmd("list", "list adapter records", _list)
    p.add_argument("--model", default=None, help="only this model's adapters")
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p = cmd("retire", "retire an adapter (404 from now on)", _retire)
    p.add_argument("name")
    p.add_argument("--model", default=None, help="the model, when several models have an adapter of this name")


async def _register(reg, args) -> int:
    from control.state.adapters import adapter_record, check_peft_dir
    from control.state.names import adapter_key, parse_model_ref

    ref = parse_model_ref(args.model)
    if ref.version is None or ref.adapter is not None:
        raise ValueError(f"--model {args.model!r} must be MODEL@VERSION")
    manifest = await reg.get_model_version(ref.name, ref.version)
    if manifest is None or manifest.get("status", "active") != "active":
        raise ValueError(f"--model {args.model}: no active version {ref.version} of {ref.name} is registered")
    path = os.path.abspath(os.path.expanduser(args.path))
    meta = check_peft_dir(path)
    for t in args.tenant:
        if await reg.get_tenant(t) is None:
            raise ValueError(f"--tenant {t}: no such tenant (actorserve tenants list)")
    record = adapter_record(args.name, ref.name, ref.version, path, args.tenant, meta["rank"], meta["alpha"])
    old = await reg.get_json(adapter_key(ref.name, args.name))
    await reg.put_json(adapter_key(ref.name, args.name), record)
    again = " again (workers read its files anew)" if old else ""
    print(f"adapter {ref.name}:{args.name} registered{again} for {ref.name}@{ref.version} (r={meta['rank']}, {path}); "
          f"requests name model \"{ref.name}:{args.name}\"")
    if meta["rank"] > DEFAULT_MAX_RANK:
        print(f"note: r={meta['rank']} is above the workers' default --max-lora-rank {DEFAULT_MAX_RANK}: "
              "workers started with a lower one refuse its requests", file=sys.stderr)
    return 0


async def _list(reg, args) -> int:
    rows = [r for recs in (await reg.list_adapters()).values() for r in recs.values()
            if args.model is None or r.get("model") == args.model]
    rows.sort(key=lambda r: (r.get("model", ""), r.get("adapter", "")))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'ADAPTER':40} {'VERSION':32} {'STATUS':8} {'RANK':>4}  TENANTS  PATH")
    for r in rows:
        print(f"{r['model'] + ':' + r['adapter']:40} {r['model'] + '@' + r['version']:32} {r.get('status', 'active'):8} "
              f"{r.get('rank', 0):>4}  {','.join(r.get('tenants') or []) or '*':7}  {r.get('path', '')}")
    return 0


async def _retire(reg, args) -> int:
    from control.state.adapters import retired
    from control.state.names import adapter_key

    from control.state.names import parse_model_ref

    model = parse_model_ref(args.model).name if args.model else None  # MODEL or MODEL@VERSION
    found = [(m, recs[args.name]) for m, recs in (await reg.list_adapters()).items()
             if args.name in recs and (model is None or m == model)]
    if not found:
        raise ValueError(f"no adapter {args.name!r} is registered" + (f" for {args.model}" if args.model else ""))
    if len(found) > 1:
        raise ValueError(f"adapter {args.name!r} exists for {', '.join(m for m, _ in found)}: name one with --model")
    model, record = found[0]
    if record.get("status") == "retired":
        print(f"adapter {model}:{args.name} was retired already")
        return 0
    await reg.put_json(adapter_key(model, args.name), retired(record))
    print(f"adapter {model}:{args.name} retired")
    return 0
