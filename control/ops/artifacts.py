"""A model artifact checked before it is registered: its format (a GGUF file or a Hugging Face directory), whether
the engine's architecture spec takes it, and the facts a manifest defaults to.

One path for both callers that register a model from a file: ``actorserve models register`` (models_cli.py) and
``actorserve up --model-file`` / ``models register-default --model-file`` (deploy.py). Nothing is loaded: a GGUF's
tensor table is read through a memory map (``gguf.GGUFReader``), a directory's ``config.json`` and safetensors
headers only (actors/worker/engine/hf_loader.py). Every refusal is a ValueError naming the file, field or tensor
(FileNotFoundError for a path that does not exist).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger("actorserve.artifacts")

# GGUF general.file_type codes (llama.cpp's LLAMA_FTYPE_*) for the common quantizations.
GGUF_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 32: "BF16",
}


@dataclass(frozen=True)
class ArtifactFacts:
    """What a checked artifact tells a manifest: ``format`` (``gguf`` | ``hf``), ``context_length`` (tokens; GGUF
    ``{arch}.context_length`` or config.json ``max_position_embeddings``; None when absent), ``quantization`` (a
    GGUF's file type label, e.g. ``Q4_1``; None for a directory or an unknown code), ``memory_bytes`` (the bytes the
    engine will hold: ``loaded_bytes``)."""

    format: str
    context_length: int | None
    quantization: str | None
    memory_bytes: int


def artifact_format(path: str, given: str | None = None) -> str:
    """``given`` when set, else ``hf`` for an existing directory and ``gguf`` otherwise (the inference
    ``models register`` and ``up --model-file`` share; the manifest itself, which does no I/O, infers from a
    trailing ``/``: control/state/manifest.py ``infer_format``)."""
    return given or ("hf" if os.path.isdir(path) else "gguf")


def inspect_artifact(path: str, fmt: str | None = None) -> ArtifactFacts:
    """Check the artifact at ``path`` (absolute) in format ``fmt`` (None: inferred, ``artifact_format``) and
    return its facts. Raises FileNotFoundError when nothing is at ``path``, ValueError naming the file, field or
    tensor the engine would refuse (another format than gguf / hf is the manifest's to refuse, not checked here)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"artifact {path} does not exist")
    fmt = artifact_format(path, fmt)
    if fmt == "hf":
        ctx, size = check_hf_dir(path)
        return ArtifactFacts("hf", ctx, None, loaded_bytes(path) or size)
    if not os.path.isfile(path):
        raise ValueError(f"artifact {path} does not exist (or is not a file; a Hugging Face directory is registered "
                         "with --format hf or a path ending in /)")
    check_gguf(path)
    check_gguf_tensors(path)
    ctx, quant = gguf_facts(path)
    return ArtifactFacts("gguf", ctx, quant, loaded_bytes(path))


def loaded_bytes(path: str) -> int:
    """The bytes the engine will hold for the artifact (engine/loaded_bytes.py: the loaded form under the default
    quantization, bfloat16; a K-quant or GPTQ file held as the engine's int4 is not its file size), else the
    file's size when its header cannot be read that way (0 for a directory)."""
    # the engine's estimate (numpy, safetensors): imported only by the verbs that register, never by `--help`
    from actors.worker.engine.loaded_bytes import loaded_bytes as engine_loaded_bytes

    try:
        return engine_loaded_bytes(path)
    except (ValueError, OSError, KeyError):
        return os.path.getsize(path) if os.path.isfile(path) else 0


def check_gguf(path: str) -> None:
    """ValueError unless ``path`` starts with the GGUF magic ``b"GGUF"`` (GGUF spec, ggml docs/gguf.md). The file's
    bytes are never quoted (it may be anything)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ValueError(f"artifact {path} cannot be read: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise ValueError(f"artifact {path} is not a GGUF file (format gguf): it does not start with the GGUF magic")


def check_gguf_tensors(path: str) -> None:
    """The GGUF's architecture, config values and every tensor must be ones the engine's spec takes (the tensor
    table read through a memory map; no weight loaded). ValueError ``artifact PATH: ...`` naming the field or
    tensor."""
    # the engine's spec and loader (torch): imported only when a model file is checked, never by `--help`
    import gguf

    from actors.worker.engine.gguf_loader import account_tensors, read_config

    try:
        reader = gguf.GGUFReader(path)
        account_tensors(reader, read_config(reader), path)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"artifact {path}: {e}") from None


def gguf_facts(path: str) -> tuple[int | None, str | None]:
    """(context_length, quantization) from a GGUF's metadata; (None, None) if unreadable (logged)."""
    try:
        from actors.text.gguf_meta import read_gguf_metadata

        meta = read_gguf_metadata(path, full_arrays=())
    except Exception as e:  # the manifest can still name the file; the worker reports problems
        log.warning("could not read GGUF metadata of %s: %s", path, e)
        return None, None
    arch = meta.get("general.architecture")
    ctx = meta.get(f"{arch}.context_length") if arch else None
    ftype = meta.get("general.file_type")
    quant = GGUF_FILE_TYPES.get(ftype) if isinstance(ftype, int) else None
    return (int(ctx) if isinstance(ctx, int) and ctx > 0 else None), quant


def check_hf_dir(path: str) -> tuple[int | None, int]:
    """A Hugging Face directory must hold a config.json the engine's spec takes, safetensors whose every tensor it
    accounts for (headers only, nothing loaded) and a tokenizer.json. Returns (context_length from
    ``max_position_embeddings`` or None, bytes of the weight files). ValueError naming the file, field or tensor."""
    if not os.path.isdir(path):
        raise ValueError(f"artifact {path} is not a directory (format hf)")
    # the engine's spec and loader (torch): imported only when a model directory is checked, never by `--help`
    from actors.worker.engine.hf_loader import account_tensors, artifact_bytes, read_config

    try:
        cfg = read_config(path)
        account_tensors(path, cfg)
    except (ValueError, OSError) as e:
        raise ValueError(f"artifact {path}: {e}") from None
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ValueError(f"artifact {path} has no tokenizer.json (format hf needs it)")
    return int(cfg.context_length) or None, artifact_bytes(path)
