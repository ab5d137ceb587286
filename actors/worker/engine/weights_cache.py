"""What the engine reads from a model artifact (a GGUF file or a Hugging Face directory, hf_loader.py), and a
load-optimized cache of it (issue 17 item 3; directories: issue 20).

``read_artifact(path, dtype, device, ...)`` returns an ``Artifact``: the model config, the weights
converted to the engine dtype, the GGUF types of the projection tensors (for ``--quantization auto``),
the detokenizer's bytes table and the control-token names.  From the GGUF itself that costs a
``gguf.GGUFReader`` parse (its Python parse of ~100k tokenizer entries: 2.5-14 s for SmolLM2-135M on
2 shared cores) plus the dequantization of every tensor (numpy, 3-4 s).  With the cache on, the first
load writes all of it into one safetensors file (weights as they are in memory, metadata and token
tables as JSON / byte tensors); a later load of the same artifact (path, size, mtime), dtype and
loader source reads that file instead: memory-mapped (``safetensors.safe_open``), no GGUF parse, no
dequantization.

Cache folder: ``$ACTORSERVE_CACHE_DIR/weights`` (default ``~/.cache/actorserve/weights``), files
``<key>.safetensors``; at most ``$ACTORSERVE_WEIGHTS_CACHE_BYTES`` (default 8 GiB) in all: the least
recently used files go first.  Writes are atomic (temporary file, then rename); an unreadable or
mismatching file is removed and the GGUF read again.  Format: safetensors (Hugging Face,
https://huggingface.co/docs/safetensors), the load-optimized format ServerlessLLM and vLLM load from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .arch_spec import ModelConfig
from .detokenizer import TokenBytes
from .gguf_loader import account_tensors, load_gguf, read_config

log = logging.getLogger("actorserve.engine")

FORMAT = "actorserve-weights-1"  # bump when the file layout changes
DEFAULT_MAX_BYTES = 8 * 2**30
_PROJECTIONS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
                "ffn_up.weight", "ffn_down.weight",
                "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")  # stacked experts (moe.py)


@dataclass
class Artifact:
    """What the engine needs of a model file.  ``weights``: ``{name: tensor}`` in the engine dtype on the
    engine device (names of ``gguf_loader.load_gguf``; ``lm_head`` may be ``embed`` itself)."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tensor_types: list[str]  # GGUF type names of the projection tensors, e.g. ["Q4_1", ...]
    token_bytes: list[bytes]  # detokenizer table (detokenizer.load_token_bytes: a TokenBytes)
    special_names: dict[int, str]  # control tokens {id: name} (structured.special_token_names)
    phases: dict[str, float] = field(default_factory=dict)  # seconds: artifact_read, convert
    cached: bool = False  # True when read from the converted-weights cache


def cache_dir() -> Path:
    """``$ACTORSERVE_CACHE_DIR/weights`` or ``~/.cache/actorserve/weights``."""
    root = os.environ.get("ACTORSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "actorserve")
    return Path(root) / "weights"


def cache_key(path: str, dtype: torch.dtype) -> str:
    """sha256 over the artifact's identity (absolute path, size, mtime of each of its files), the dtype and the
    loaders' source (detokenizer.py: the cached token table)."""
    from .hf_loader import artifact_stamp

    h = hashlib.sha256("\n".join([FORMAT, *artifact_stamp(path), str(dtype)]).encode())
    for mod in ("gguf_loader.py", "hf_loader.py", "arch_spec.py", "weights_cache.py", "detokenizer.py",
                "hf_quant.py"):
        h.update((Path(__file__).parent / mod).read_bytes())
    return h.hexdigest()[:32]


def read_artifact(path: str, dtype: torch.dtype, device: str = "cpu", progress: bool = False,
                  use_cache: bool = False) -> Artifact:
    """The ``Artifact`` of the GGUF at ``path`` (module docstring); ``use_cache`` reads / writes the
    converted-weights cache.  Errors of the GGUF read propagate (ValueError / OSError); a cache that
    cannot be read or written is logged and bypassed."""
    file = cache_dir() / f"{cache_key(path, dtype)}.safetensors" if use_cache else None
    if file is not None and file.exists():
        art = _read_cached(file, device)
        if art is not None:
            return art
    art = _read_hf(path, dtype, device, progress) if os.path.isdir(path) else _read_gguf(path, dtype, device, progress)
    if file is not None:
        _write_cached(file, art)
    return art


def _read_gguf(path: str, dtype: torch.dtype, device: str, progress: bool) -> Artifact:
    import gguf

    from .detokenizer import load_token_bytes
    from .structured import special_token_names

    t0 = time.monotonic()
    reader = gguf.GGUFReader(path)
    account_tensors(reader, read_config(reader), path)  # refuse an unsupported file before reading anything else
    types = [t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and t.name.endswith(_PROJECTIONS)]
    token_bytes, special = load_token_bytes(path, reader=reader), special_token_names(path, reader)
    t1 = time.monotonic()
    config, weights = load_gguf(path, dtype, device, progress, reader)
    return Artifact(config, weights, types, token_bytes, special,
                    {"artifact_read": t1 - t0, "convert": time.monotonic() - t1})


def _read_hf(path: str, dtype: torch.dtype, device: str, progress: bool) -> Artifact:
    from .hf_loader import load_hf, token_tables, tensor_types

    t0 = time.monotonic()
    config, weights = load_hf(path, dtype, device, progress)
    t1 = time.monotonic()
    token_bytes, special = token_tables(path, config.vocab_size)
    return Artifact(config, weights, tensor_types(path), token_bytes, special,
                    {"artifact_read": time.monotonic() - t1, "convert": t1 - t0})


def _write_cached(file: Path, art: Artifact) -> None:
    """Write ``art`` to ``file`` atomically, then trim the folder; failures are logged, never raised."""
    try:
        t0 = time.monotonic()
        file.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in art.weights.items()
                   if not (k == "lm_head" and v is art.weights.get("embed"))}
        tensors["__token_bytes"], tensors["__token_offsets"] = _pack_bytes(art.token_bytes)
        meta = {"format": FORMAT, "config": json.dumps(dataclasses.asdict(art.config)),
                "tensor_types": json.dumps(art.tensor_types),
                "special_names": json.dumps({str(k): v for k, v in art.special_names.items()}),
                "token_lead": json.dumps([getattr(art.token_bytes, "lead", "keep"),
                                          sorted(getattr(art.token_bytes, "keep_ids", ()))]),
                "tied_lm_head": "1" if "lm_head" not in tensors else "0"}
        _save_atomic(tensors, file, meta)
        log.info("converted weights cached in %s (%.0f MB, %.1f s)", file, file.stat().st_size / 1e6,
                 time.monotonic() - t0)
        trim(file.parent, keep=file)
    except (OSError, RuntimeError, ValueError) as exc:
        log.warning("converted-weights cache not written (%s): the next load reads the GGUF again", exc)


def _read_cached(file: Path, device: str) -> Artifact | None:
    """The artifact from a cache file, or None (the file removed) when it cannot be read."""
    from safetensors import SafetensorError, safe_open

    t0 = time.monotonic()
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}")
            weights = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("__")}
            token_bytes = _unpack_bytes(f.get_tensor("__token_bytes"), f.get_tensor("__token_offsets"))
        config = ModelConfig.from_dict(json.loads(meta["config"]))
        special = {int(k): v for k, v in json.loads(meta["special_names"]).items()}
        types = list(json.loads(meta["tensor_types"]))
        lead, keep_ids = json.loads(meta.get("token_lead", '["keep", []]'))
        token_bytes = TokenBytes(token_bytes, lead, keep_ids)  # the detokenizer's first-token rule
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
        log.warning("converted-weights cache %s unreadable (%s): removed, reading the GGUF", file, exc)
        file.unlink(missing_ok=True)
        return None
    t1 = time.monotonic()
    weights = {k: v.to(device) for k, v in weights.items()}
    if meta.get("tied_lm_head") == "1":
        weights["lm_head"] = weights["embed"]
    os.utime(file)  # recently used: trimmed last
    return Artifact(config, weights, types, token_bytes, special,
                    {"artifact_read": t1 - t0, "convert": time.monotonic() - t1}, cached=True)


def _save_atomic(tensors: dict[str, torch.Tensor], file: Path, meta: dict[str, str]) -> None:
    """safetensors ``file`` written through a temporary file in its folder, then renamed (OSError etc. raise)."""
    from safetensors.torch import save_file

    fd, tmp = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, file)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _pack_bytes(items: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte strings -> (uint8 [total] concatenation, int64 [n + 1] offsets)."""
    offsets = [0]
    for b in items:
        offsets.append(offsets[-1] + len(b))
    data = torch.frombuffer(bytearray(b"".join(items)) or bytearray(1), dtype=torch.uint8)
    return data.clone(), torch.tensor(offsets, dtype=torch.int64)


def _unpack_bytes(data: torch.Tensor, offsets: torch.Tensor) -> list[bytes]:
    raw, off = data.numpy().tobytes(), offsets.tolist()
    return [raw[a:b] for a, b in zip(off, off[1:])]


def trim(folder: Path, keep: Path | None = None, max_bytes: int | None = None) -> list[Path]:
    """Remove the least recently used cache files of ``folder`` (never ``keep``) until they total at most
    ``max_bytes`` (default ``$ACTORSERVE_WEIGHTS_CACHE_BYTES`` or DEFAULT_MAX_BYTES); returns those removed."""
    limit = max_bytes if max_bytes is not None else int(os.environ.get("ACTORSERVE_WEIGHTS_CACHE_BYTES",
                                                                       DEFAULT_MAX_BYTES))
    files = sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
    total, removed = sum(p.stat().st_size for p in files), []
    for p in files:
        if total <= limit:
            break
        if p != keep:
            total -= p.stat().st_size
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


class PackCache:
    """The block-quantized packs (``QuantLinear.packed``) of a model's projections, cached next to the
    converted weights (``<key>-<quantization>-<isa>.safetensors``) so a warm load skips quantization.

    ``wrap(make_linear)`` returns a factory for ``LlamaModel``: on a hit it rebuilds the n-th projection
    from its stored pack (``QuantLinear.from_packed``), else it builds it and records the pack; ``save()``
    writes what was recorded (atomically; failures logged).  Projections of other kinds are built as usual."""

    def __init__(self, path: str, dtype: torch.dtype, quantization: str | None, kernels, variant: str = "") -> None:
        """``variant``: what else decides which projections reach the factory (kquant.pack_variant), in the key."""
        from . import quant_blocks

        isa = getattr(kernels, "qgemm_isa", "none")
        src = hashlib.sha256(Path(quant_blocks.__file__).read_bytes()).hexdigest()[:8]
        self.file = cache_dir() / f"{cache_key(path, dtype)}-{quantization}-{isa}-{src}{variant}.safetensors"
        self.kernels, self.stored, self.recorded = kernels, self._load(), {}
        self.hit = bool(self.stored)

    def _load(self) -> dict[str, torch.Tensor]:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if not self.file.exists():
            return {}
        try:
            return load_file(str(self.file))
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            log.warning("quantized-pack cache %s unreadable (%s): removed", self.file, exc)
            self.file.unlink(missing_ok=True)
            return {}

    def wrap(self, make_linear):
        """The caching factory around ``make_linear(weight, name)``."""
        from .quant_blocks import QuantLinear

        count = [0]

        def make(weight: torch.Tensor, name: str):
            key, count[0] = f"{count[0]}.{name}", count[0] + 1
            if key + ".packed" in self.stored:
                meta = self.stored[key + ".meta"].tolist()  # [bits, out_features]
                return QuantLinear.from_packed(self.stored[key + ".packed"], meta[0], meta[1], self.kernels)
            lin = make_linear(weight, name)
            if isinstance(lin, QuantLinear):
                self.recorded[key + ".packed"] = lin.packed
                self.recorded[key + ".meta"] = torch.tensor([lin.bits, lin.out_features], dtype=torch.int64)
            return lin
        return make

    def save(self) -> None:
        """Write the recorded packs (nothing on a hit or when none was recorded)."""
        if self.hit or not self.recorded:
            return
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            _save_atomic(self.recorded, self.file, {"format": FORMAT})
            trim(self.file.parent, keep=self.file)
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("quantized-pack cache not written (%s)", exc)
        self.recorded = {}
