"""What a multi-version host measured of each artifact it loaded (weight bytes, load seconds), kept across its
restarts in ``$ACTORSERVE_CACHE_DIR/host_measured.json`` (default ``~/.cache/actorserve``), so that the residency
policy's first estimate of a version is the converted size seen before on this machine, not the artifact's file
size (a GGUF of SmolLM2-135M Q4_1 is 98 MB; its converted weights on a bfloat16+int4 path are 378 MiB).

An entry is keyed by the host's share key (artifact | dtype flag | quantization) and holds the artifact's size
and mtime: a changed file invalidates it. Writes are atomic (temporary file, rename); an unreadable file reads
as empty.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def measured_path() -> Path:
    """``$ACTORSERVE_CACHE_DIR/host_measured.json`` (or under ``~/.cache/actorserve``)."""
    root = os.environ.get("ACTORSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "actorserve")
    return Path(root) / "host_measured.json"


def _stamp(artifact: str) -> list[int]:
    """[size, mtime_ns] of a GGUF file; of a Hugging Face directory, its files' total size and newest mtime."""
    if os.path.isdir(artifact):
        from actors.worker.engine.hf_loader import artifact_files

        try:
            stats = [f.stat() for f in artifact_files(artifact)]
        except (OSError, ValueError):
            return [-1, -1]
        return [sum(int(st.st_size) for st in stats), max(int(st.st_mtime_ns) for st in stats)]
    try:
        st = os.stat(artifact)
    except OSError:
        return [-1, -1]
    return [int(st.st_size), int(st.st_mtime_ns)]


def load_measured(path: Path | None = None) -> dict[str, tuple[int, float]]:
    """``{share key: (weights bytes, load s)}`` of the entries whose artifact is unchanged."""
    try:
        raw = json.loads((path or measured_path()).read_text())
    except (OSError, ValueError):
        return {}
    out: dict[str, tuple[int, float]] = {}
    for key, e in raw.items() if isinstance(raw, dict) else ():
        stamp = _stamp(key.split("|", 1)[0])
        if isinstance(e, dict) and stamp[0] >= 0 and e.get("stamp") == stamp:
            out[key] = (int(e.get("weights_bytes", 0)), float(e.get("load_s", 5.0)))
    return out


def save_measured(measured: dict[str, tuple[int, float]], path: Path | None = None) -> None:
    """Write ``measured`` (with each artifact's stamp); an unwritable folder is ignored (the figures are
    measured again next time)."""
    path = path or measured_path()
    data = {k: {"weights_bytes": w, "load_s": round(s, 3), "stamp": _stamp(k.split("|", 1)[0])}
            for k, (w, s) in measured.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".host_measured.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass
