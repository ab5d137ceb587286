"""The engine path a worker runs by default: ``choose(model_path, ...) -> Choice`` (dtype, quantization, why).

1. Rank the candidate paths by ISA and the file's own precision (``kernel_policy.rank``; pins filter).
2. One candidate, or a clear record (``kernel_policy.close`` false): take the first.
3. Else measure the first two for a few hundred ms (``measure``): the model's four projection
   products of one layer (synthetic weights of the file's shapes, built by the engine's own
   ``quant.make_linear_factory``) times its layer count, plus the LM head, at 1 and 32 rows, weights
   evicted from the caches before each pass (decode streams them from memory); pick by
   ``kernel_policy.decide``.
4. Cache the answer as JSON in ``cache_path()`` (``$ACTORSERVE_CACHE_DIR`` or ``~/.cache/actorserve``,
   file ``kernel_choice.json``) under a key of: the ISA flags, the model file (path, size, mtime), the
   pins (a manifest's quantization included; not the version's name: a new version of the same file
   reuses the answer), the sources of the kernels / quantizers / this policy, torch's version and the
   thread count.  A later start with the same key reads it (no GGUF parse, no measurement).

Shapes come from the GGUF header (``read_shapes``: tensor names, types and dims only; the tokenizer
arrays are skipped without being decoded, ~0.1 s against seconds for ``gguf.GGUFReader``).  Format:
ggml's docs/gguf.md (v2/v3: little-endian, u64 lengths and counts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import kernel_policy as policy

log = logging.getLogger(__name__)

Q8_0_TYPE = 8  # ggml_type GGML_TYPE_Q8_0 (ggml.h)
CACHE_FILE = "kernel_choice.json"
CACHE_ENTRIES = 64  # newest entries kept in the cache file
_SOURCES = ("quant.py", "quant_blocks.py", "model.py", "cpu_kernels.py", "kernel_policy.py", "kernel_choice.py",
            "row_kernels.py")
_PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
         "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # the last three: stacked experts (moe.py)


@dataclass(frozen=True)
class Choice:
    """The resolved path: ``dtype`` ("float32" | "bfloat16"), ``quantization`` (None | "int8" | "int4";
    "auto" only with a pinned dtype, see ``choose``),
    ``reason`` (one line for logs), ``measured`` ({label: {"1": tok/s, "32": tok/s}}, may be empty),
    ``cached`` (the cache file it was read from, or written to; None when not cached)."""

    dtype: str
    quantization: str | None
    reason: str
    measured: dict
    cached: str | None = None
    row_table: dict | None = None  # the kernel per step row count (row_kernels.RowTable.to_json()), or None

    def with_rows(self, table: dict | None) -> "Choice":
        """This choice with ``row_table`` set."""
        return Choice(self.dtype, self.quantization, self.reason, self.measured, self.cached, table)

    @property
    def label(self) -> str:
        return self.dtype + (f"+{self.quantization}" if self.quantization else "")

    def line(self) -> str:
        """The start-up line: ``engine path bfloat16+int4: avx512_bf16, measured ...; kernels by rows 1 avx2,
        2-4 avx512, ...; cached <path>``."""
        from .row_kernels import RowTable

        rows = RowTable.from_json(self.row_table) if self.row_table else None
        return (f"engine path {self.reason}" + (f"; kernels by rows {rows.line()}" if rows else "")
                + (f"; cached {self.cached}" if self.cached else ""))


@dataclass(frozen=True)
class Shapes:
    """Per-layer projection shapes of a GGUF Llama ([out, in] each), its layer count, vocabulary and the
    GGUF type names of its projection tensors."""

    layers: int
    qkv: tuple[int, int]
    o: tuple[int, int]
    gate_up: tuple[int, int]
    down: tuple[int, int]
    vocab: int
    hidden: int
    proj_types: tuple[str, ...]


# ------------------------------------------------------------------------------------ GGUF header


_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _skip_value(buf, off: int, vtype: int) -> int:
    """Offset after one metadata value of GGUF type ``vtype`` at ``off``."""
    if vtype in _SCALAR:
        return off + struct.calcsize("<" + _SCALAR[vtype])
    if vtype == 8:  # string: u64 length + bytes
        return off + 8 + struct.unpack_from("<Q", buf, off)[0]
    if vtype == 9:  # array: u32 element type, u64 count, elements
        etype, n = struct.unpack_from("<IQ", buf, off)
        off += 12
        if etype in _SCALAR:
            return off + n * struct.calcsize("<" + _SCALAR[etype])
        for _ in range(n):
            off = _skip_value(buf, off, etype)
        return off
    raise ValueError(f"GGUF: unknown metadata value type {vtype}")


def _string(buf, off: int) -> tuple[str, int]:
    n = struct.unpack_from("<Q", buf, off)[0]
    return bytes(buf[off + 8:off + 8 + n]).decode("utf-8", "replace"), off + 8 + n


def read_tensor_infos(path: str) -> dict[str, tuple[tuple[int, ...], int]]:
    """{tensor name: (dims in ggml order, i.e. [in, out] for a weight; ggml type id)} from the header.
    ValueError for a file that is not GGUF v2/v3."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a GGUF v2/v3 file (magic {magic!r}, version {version})")
        off = 24
        for _ in range(n_kv):
            _, off = _string(buf, off)
            off = _skip_value(buf, off + 4, struct.unpack_from("<I", buf, off)[0])
        infos = {}
        for _ in range(n_tensors):
            name, off = _string(buf, off)
            nd = struct.unpack_from("<I", buf, off)[0]
            dims = struct.unpack_from(f"<{nd}Q", buf, off + 4)
            ttype = struct.unpack_from("<I", buf, off + 4 + 8 * nd)[0]
            infos[name] = (tuple(dims), ttype)
            off += 4 + 8 * nd + 4 + 8
        return infos


def read_shapes(path: str) -> Shapes:
    """Projection shapes of layer 0, the layer count and vocabulary (ValueError if a tensor is missing); a
    Hugging Face directory's from its config.json (its safetensors dtypes as the types: never a GGUF block
    type, so no quantization follows the file)."""
    import gguf

    if os.path.isdir(path):
        from .hf_loader import read_config, tensor_types

        c = read_config(path)
        hd, d = c.head_dim, c.hidden_size
        return Shapes(c.num_layers, ((c.num_heads + 2 * c.num_kv_heads) * hd, d), (d, c.num_heads * hd),
                      (2 * c.ffn_size, d), (d, c.ffn_size), c.vocab_size, d, tuple(tensor_types(path)))
    infos = read_tensor_infos(path)

    def dims(name: str) -> tuple[int, int]:
        if name not in infos:
            raise ValueError(f"{path}: tensor {name} missing from the GGUF header")
        d = infos[name][0]
        return int(d[1]), int(d[0])  # ggml [in, out] -> [out, in]

    q, k, v = dims("blk.0.attn_q.weight"), dims("blk.0.attn_k.weight"), dims("blk.0.attn_v.weight")
    ffn = "" if "blk.0.ffn_gate.weight" in infos or "blk.0.ffn_gate_exps.weight" not in infos else "_exps"
    gate, down = dims(f"blk.0.ffn_gate{ffn}.weight"), dims(f"blk.0.ffn_down{ffn}.weight")  # _exps: one expert
    vocab, hidden = dims("token_embd.weight")
    layers = len({n.split(".")[1] for n in infos if n.startswith("blk.")})
    types = tuple(gguf.GGMLQuantizationType(t).name for n, (_, t) in infos.items()
                  if n.startswith("blk.") and n.split(".")[2] in _PROJ)
    return Shapes(layers, (q[0] + k[0] + v[0], q[1]), dims("blk.0.attn_output.weight"), (2 * gate[0], gate[1]),
                  down, vocab, hidden, types)


# ------------------------------------------------------------------------------------ measurement


def _llc_bytes() -> int:
    """Last-level cache size (bytes) from sysfs; 32 MiB where unknown."""
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (idx / "size").read_text().strip()
            best = max(best, int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}.get(size[-1], 1))
        except (OSError, ValueError):
            continue
    return best or 32 << 20


def _layer_ops(cand: policy.Candidate, shapes: Shapes, kernels):
    """The four projections of one layer, built as the engine builds them (``quant.make_linear_factory``,
    else ``model.dense_linear_factory``) on uniform(-0.05, 0.05) weights: [(callable, in_features)]."""
    import torch

    from .model import dense_linear_factory, packed_linear_factory
    from .quant import make_linear_factory

    dt = torch.bfloat16 if cand.dtype == "bfloat16" else torch.float32
    make = make_linear_factory(cand.quantization, packed_linear_factory(dt, "cpu"), kernels=kernels) \
        or dense_linear_factory(dt, "cpu")
    return [(make(torch.empty(*shape, dtype=dt).uniform_(-0.05, 0.05), name), shape[1])
            for name, shape in (("qkv", shapes.qkv), ("o", shapes.o), ("gate_up", shapes.gate_up),
                                ("down", shapes.down))]


def _head_ms(dtype: str, shapes: Shapes, flush, reps: int) -> dict[int, float]:
    """ms of the dense LM head [vocab, hidden] at each of LEVELS rows (constant weights: a dense
    product's speed does not depend on the values; filling random ones costs ~0.2 s)."""
    import torch

    from .model import dense_linear_factory

    from .model import PackedLinear

    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    w = torch.full((shapes.vocab, shapes.hidden), 0.01, dtype=dt)
    head = dense_linear_factory(dt, "cpu")(w, "lm_head")
    out = {}
    for rows in policy.LEVELS:
        h = torch.empty(rows, shapes.hidden, dtype=dt).uniform_(-1, 1)
        if rows > 1 and not isinstance(head, PackedLinear):  # as LlamaModel's head: (W @ h^T)^T for many rows
            out[rows] = _best_ms(lambda: (w @ h.t()).t(), flush, reps)
        else:
            out[rows] = _best_ms(lambda: head(h), flush, reps)
    return out


def _best_ms(fn, flush, reps: int, warm: bool = True) -> float:
    """Fastest of ``reps`` timed calls of ``fn`` (ms), each after ``flush()`` (first one untimed warm-up
    call unless ``warm`` is False)."""
    if warm:
        fn()
    best = float("inf")
    for _ in range(reps):
        flush()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def measure(cands: list[policy.Candidate], shapes: Shapes, kernels=None, reps: int = 5,
            threads: int | None = 1) -> dict[str, dict]:
    """Estimated decode tok/s at ``kernel_policy.LEVELS`` rows per candidate:
    ``rows / (layers * t(one layer's 4 products) + t(LM head))``, each time the best of ``reps`` passes
    (candidates interleaved, so both see the same background load) with the caches flushed (a read of
    twice the last-level cache) before each.  ``threads`` (default 1; None = torch's current count): one
    thread is not stalled by a descheduled sibling while the rest of the stack starts beside the worker
    (2 threads under load 4 on 2 cores measured 11 ms against 0.06 for one int4 product, decision 0028),
    and the ratio between paths, not the absolute rate, decides.  Attention, norms and host overhead are
    left out: figures are upper bounds, comparable between candidates.
    Returns {label: {"1": tok/s, "32": tok/s, "ms": wall ms spent building and timing it}}."""
    with _threads(threads):
        return _measure(cands, shapes, kernels, reps)


@contextlib.contextmanager
def _threads(threads: int | None):
    """torch on ``threads`` threads inside (None: unchanged), its count before restored after."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _flush_buffer():
    """A float32 tensor of twice the last-level cache: its ``sum`` evicts the weights before a timed pass."""
    import torch

    return torch.ones(2 * _llc_bytes() // 4, dtype=torch.float32)


def _measure(cands: list[policy.Candidate], shapes: Shapes, kernels, reps: int) -> dict[str, dict]:
    import torch

    junk = _flush_buffer()
    heads: dict[str, dict[int, float]] = {}
    built, spent = {}, {}
    with torch.inference_mode():
        for cand in cands:
            t0 = time.perf_counter()
            built[cand] = _layer_ops(cand, shapes, kernels)
            if cand.dtype not in heads:
                heads[cand.dtype] = _head_ms(cand.dtype, shapes, junk.sum, reps)
            spent[cand] = time.perf_counter() - t0
        best = {(c, n): float("inf") for c in cands for n in policy.LEVELS}
        for rows in policy.LEVELS:
            t0 = time.perf_counter()
            calls = {}
            for cand, ops in built.items():
                dt = torch.bfloat16 if cand.dtype == "bfloat16" else torch.float32
                xs = [torch.empty(rows, k, dtype=dt).uniform_(-1, 1) for _, k in ops]
                calls[cand] = lambda ops=ops, xs=xs: [op(x) for (op, _), x in zip(ops, xs)]
                calls[cand]()  # warm-up (oneDNN builds a primitive per shape)
            for _ in range(reps):
                for cand, fn in calls.items():
                    best[cand, rows] = min(best[cand, rows], _best_ms(fn, junk.sum, 1, warm=False))
            for cand in cands:
                spent[cand] += (time.perf_counter() - t0) / len(cands)
    return {c.label: {**{str(n): n * 1e3 / (shapes.layers * best[c, n] + heads[c.dtype][n]) for n in policy.LEVELS},
                      "ms": spent[c] * 1e3} for c in cands}


# ------------------------------------------------------------------------------------ cache


def cache_path() -> Path:
    """``$ACTORSERVE_CACHE_DIR/kernel_choice.json`` (default ``~/.cache/actorserve/kernel_choice.json``)."""
    return Path(os.environ.get("ACTORSERVE_CACHE_DIR") or Path.home() / ".cache" / "actorserve") / CACHE_FILE


def cache_key(model_path: str, flags, device: str, dtype: str, quantization: str) -> str:
    """sha256 over what the answer depends on (module docstring, step 4): the file, not the version naming it."""
    import torch

    here = Path(__file__).parent
    from .hf_loader import artifact_stamp

    h = hashlib.sha256()
    parts = [",".join(sorted(flags)), *artifact_stamp(model_path),
             device, dtype, quantization, torch.__version__, str(torch.get_num_threads()),
             "block_quant=" + os.environ.get("ACTORSERVE_BLOCK_QUANT", ""), "isa=" + os.environ.get("ACTORSERVE_ISA", "")]
    h.update("\n".join(parts).encode())
    for name in (*_SOURCES, *[f"csrc/{p.name}" for p in sorted((here / "csrc").glob("*.cpp"))]):
        try:
            h.update((here / name).read_bytes())
        except OSError:
            h.update(name.encode())
    return h.hexdigest()[:32]


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, key: str, entry: dict) -> bool:
    """Merge ``entry`` under ``key`` (keeping the newest CACHE_ENTRIES) and replace the file atomically;
    False (logged) where unwritable.  Two workers measuring at once: the last writer's merge wins."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data[key] = entry
        for old in sorted(data, key=lambda k: str(data[k].get("at", "")) if isinstance(data[k], dict) else "")[
                :max(0, len(data) - CACHE_ENTRIES)]:
            del data[old]  # oldest first: test runs make a key per temporary model file
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.warning("kernel choice: cache %s not written (%s)", path, exc)
        return False


# ------------------------------------------------------------------------------------ choice


def choose(model_path: str, model_version: str = "", device: str = "cpu", dtype: str = "auto",
           quantization: str = "auto", manifest_quantization: str | None = None, use_cache: bool = True) -> Choice:
    """``choose_path`` and, for a quantized CPU path, the kernel per step row count (``row_table``): measured
    on the model's projection shapes (``row_kernels.measure_rows``) and cached like the path, under its own
    key; off with ``ACTORSERVE_ROW_KERNELS=0``.  Raises as ``choose_path``."""
    choice = choose_path(model_path, model_version, device, dtype, quantization, manifest_quantization, use_cache)
    if (not device.startswith("cpu") or choice.quantization not in policy.QUANTIZATIONS
            or os.environ.get("ACTORSERVE_ROW_KERNELS", "1").strip() == "0"):
        return choice
    return choice.with_rows(_rows(model_path, choice, device, use_cache))


def _rows(model_path: str, choice: Choice, device: str, use_cache: bool) -> dict | None:
    """The row table of ``choice``'s path (cached under the path's key + ``:rows``), or None when fewer than
    two kernels can serve its projections or measuring failed (logged: projections as built)."""
    from . import cpu_kernels
    from .hardware import isa_flags
    from .row_kernels import table_of

    path, key = cache_path(), cache_key(model_path, isa_flags(), device, choice.dtype, choice.quantization) + ":rows"
    if use_cache:
        hit = _read_cache(path).get(key)
        if isinstance(hit, dict) and "table" in hit:
            return hit["table"]
    try:
        shapes = read_shapes(model_path)
        table = table_of(measure_layer_rows(policy.Candidate(choice.dtype, choice.quantization), shapes,
                                            cpu_kernels.load()))
        if table is not None and choice.dtype == "bfloat16" and _file_head_q8_0(model_path):
            table = dataclasses.replace(table, head=table_of(measure_layer_head(shapes, cpu_kernels.load())))
    except (RuntimeError, ValueError) as exc:  # a kernel that fails here would fail in the engine too
        log.warning("kernel choice: timing %s per row count failed (%s); projections as built", choice.label, exc)
        return None
    out = table.to_json() if table else None
    if use_cache:
        _write_cache(path, key, {"table": out, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return out


def measure_layer_rows(cand: policy.Candidate, shapes: Shapes, kernels, reps: int = 5, threads: int | None = 1):
    """``row_kernels.measure_rows`` over one layer of ``cand``'s projections (built as ``measure`` builds them),
    on ``threads`` torch threads (``measure``'s reason); {kernel: [ms at each of row_kernels.LEVELS]}."""
    import torch

    from .row_kernels import measure_rows

    if kernels is None:
        return {}
    with _threads(threads):
        dt = torch.bfloat16 if cand.dtype == "bfloat16" else torch.float32
        return measure_rows(_layer_ops(cand, shapes, kernels), dt, _flush_buffer().sum, reps)


def measure_layer_head(shapes: Shapes, kernels, reps: int = 5, threads: int | None = 1):
    """``row_kernels.measure_head_rows`` for the model's LM head shape, on ``threads`` torch threads."""
    from .row_kernels import measure_head_rows

    with _threads(threads):
        return measure_head_rows(shapes.vocab, shapes.hidden, kernels, _flush_buffer().sum, reps)


def _file_head_q8_0(model_path: str) -> bool:
    """Whether the GGUF's LM head (``output.weight``, else the tied ``token_embd.weight``, as ``kquant.head_name``)
    is stored as Q8_0 (ggml type 8)."""
    if os.path.isdir(model_path):
        return False
    infos = read_tensor_infos(model_path)
    name = next((n for n in ("output.weight", "token_embd.weight") if n in infos), None)
    return name is not None and infos[name][1] == Q8_0_TYPE


def choose_path(model_path: str, model_version: str = "", device: str = "cpu", dtype: str = "auto",
                quantization: str = "auto", manifest_quantization: str | None = None, use_cache: bool = True) -> Choice:
    """Resolve ``dtype`` / ``quantization`` ("auto" or a pin, as the worker's flags) for ``model_path``.

    Precedence: the operator's explicit values, then a manifest pin (``kernel_policy.manifest_pin`` of
    ``manifest_quantization``) for quantization, then the ranking / measurement (module docstring).
    A pinned dtype with "auto" quantization returns quantization "auto": the engine resolves it by its
    own rule for that dtype (``quant.resolve_quantization``, from the GGUF reader it opens anyway).
    ValueError names a bad ``dtype`` / ``quantization``; an unreadable GGUF header raises ValueError /
    OSError."""
    from .hardware import bf16_matmul_supported, isa_flags

    pin = policy.manifest_pin(manifest_quantization) if quantization == "auto" else None
    quant = pin or quantization
    flags = isa_flags()
    why = ", ".join(w for w in (f"--dtype {dtype}" if dtype != "auto" else "",
                                f"--quantization {quantization}" if quantization != "auto" else "",
                                f"manifest quantization {pin}" if pin else "") if w)
    if dtype != "auto" and quant != "auto":
        c = policy.rank(flags, device, None, dtype, quant)[0]
        return Choice(c.dtype, c.quantization, f"{c.label}: pinned ({why})", {})
    if dtype != "auto":  # quantization for a pinned dtype: the engine's own rule (quant.resolve_quantization)
        policy.rank(flags, device, None, dtype, quant)  # validates dtype
        return Choice(dtype, "auto", f"{dtype}+auto: pinned ({why}); quantization resolved by the engine "
                      "(quant.resolve_quantization)", {})
    if not device.startswith("cpu"):
        c = policy.rank(flags, device, None, dtype, quant, cuda_bf16=bf16_matmul_supported(device))[0]
        return Choice(c.dtype, c.quantization, f"{c.label}: {device}" + (f" ({why})" if why else ""), {})
    path = cache_path()
    key = cache_key(model_path, flags, device, dtype, quant)
    if use_cache:
        hit = _read_cache(path).get(key)
        if isinstance(hit, dict) and hit.get("dtype") in policy.DTYPES:
            return Choice(hit["dtype"], hit.get("quantization"), str(hit.get("reason", "")), hit.get("measured", {}),
                          str(path))
    choice = _resolve(model_path, flags, dtype, quant, why)
    if use_cache and _write_cache(path, key, {"dtype": choice.dtype, "quantization": choice.quantization,
                                              "reason": choice.reason, "measured": choice.measured,
                                              "flags": sorted(flags), "model": model_version or model_path,
                                              "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}):
        return Choice(choice.dtype, choice.quantization, choice.reason, choice.measured, str(path))
    return choice


def _resolve(model_path: str, flags, dtype: str, quant: str, why: str) -> Choice:
    """Rank, measure the top two where close, explain (no cache)."""
    from . import cpu_kernels
    from .quant import quantization_for_types

    shapes = read_shapes(model_path)
    cands = policy.rank(flags, "cpu", quantization_for_types(shapes.proj_types), dtype, quant)
    measured: dict = {}
    chosen = cands[0]
    if policy.close(flags, cands):
        try:
            measured = measure(cands[:2], shapes, cpu_kernels.load())
            chosen = policy.decide({policy.Candidate.parse(k): v for k, v in measured.items()})
        except (RuntimeError, ValueError) as exc:  # a kernel that fails here would fail in the engine too
            log.warning("kernel choice: measuring %s failed (%s); taking the first path without quantization",
                        [c.label for c in cands[:2]], exc)
            chosen = next((c for c in cands if c.quantization is None), cands[-1])
    cand_measured = {policy.Candidate.parse(k): v for k, v in measured.items()}
    reason = policy.explain(flags, chosen, cands, cand_measured or None)
    return Choice(chosen.dtype, chosen.quantization, reason + (f" ({why})" if why else ""), measured)
