"""Native CPU kernels of the engine, built at run time with the system C++ compiler (csrc/*.cpp).

* ``paged_decode_attention``: attention of 1-token queries reading K/V in place from the paged
  cache through each sequence's block table, where the PyTorch path copies every sequence's blocks
  out of the cache per layer (``index_select``) and runs SDPA on the copy;
* ``add_rms_norm``, ``rope_kv``, ``silu_mul``: one call each for what takes 3-12 small PyTorch ops
  (residual add + RMSNorm; RoPE on Q and K plus the K/V cache write; SwiGLU), the per-op overhead
  that dominates a small decode step;
* ``int4_linear`` (csrc/int4_gemm.cpp, CPUs with AMX-BF16): the weight-only int4 product, the
  weight dequantized tile by tile on the vector units and multiplied on the AMX tile unit (quant.py
  ``AmxInt4Linear``);
* ``prefill_attention`` (csrc/prefill_attention.cpp, AMX-BF16, head_dim 64): causal attention of
  a fresh prefill chunk, flash-style on the tile unit (model.py ``_fresh_prefill``);
* ``lora_sgmv`` (csrc/lora_sgmv.cpp, any CPU): every row's own LoRA adapter delta in one call (lora_slots.py);
* ``decode_layers`` (csrc/decode_step.cpp, any CPU): every layer of a decode step of up to 8 rows in one call,
  through the entry points above (whole_step.py);
* ``qgemm`` (csrc/qgemm.cpp, any x86-64): block-quantized weights (Q8_0 / Q4_1 forms) times
  activations quantized per row and 32-block to int8, integer dot products on AVX-512 VNNI
  (``VPDPBUSD``) or AVX2 (``VPMADDUBSW``), portable C++ elsewhere (quant.py ``QuantLinear``).

ISA (``select_isa``): ``$ACTORSERVE_ISA`` (``avx512``, ``avx2`` or ``generic``) or, unset, the best
that ``cpu_flags()`` offers.  ``avx2`` and ``generic`` build a variant without AVX-512 (``-mno-avx512f``,
and ``-mno-avx2`` for ``generic``), so every kernel's narrower path runs (and is tested) on any machine;
the AMX kernels need AVX512-BF16 and are left out of such builds.

The small-op kernels reproduce the PyTorch expression they replace, roundings included; the
attention and int4 kernels agree with theirs within the bf16 roundings their docstrings state
(tests/unit/test_cpu_kernels.py, tests/unit/test_engine_quant.py).  See docs/decisions/0006-engine-speed.md for measurements.

Build: ``g++ -O3 -march=native -fopenmp -shared`` into ``$ACTORSERVE_KERNEL_DIR`` (default
``~/.cache/actorserve/kernels``), keyed by a hash of the source, the flags, the compiler version
and this CPU's feature flags, written to a temporary name and renamed (concurrent workers race
safely), with a ``.sha256`` sidecar checked before every load (a cut file would SIGBUS in
``dlopen``).  The kernel's OpenMP calls resolve to the ``libgomp.so.1`` torch has already loaded,
so both share one thread pool.  No compiler, a failed build or ``ACTORSERVE_NATIVE_KERNELS=0`` leaves
:func:`load` returning None and the engine on the PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from .hardware import cpu_flags

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("cpu_kernels.cpp", "int4_gemm.cpp", "prefill_attention.cpp", "qgemm.cpp", "lora_sgmv.cpp",
                        "decode_step.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / "bf16.h"]  # included by SOURCES: part of the build key
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++20"]
LIBS = ["-lmvec"]  # glibc's vector math (expf x16) for the AVX-512 softmax
BUILD_TIMEOUT_S = 120
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
ISA_FLAGS = {"avx512": [], "avx2": ["-mno-avx512f"], "generic": ["-mno-avx512f", "-mno-avx2"]}
QGEMM_ISAS = {2: "avx512", 1: "avx2", 0: "generic"}  # actorserve_qgemm_isa() -> name


def select_isa() -> str:
    """``$ACTORSERVE_ISA`` if set (raises ValueError on a name not in ``ISA_FLAGS``), else "avx512"
    where the CPU has AVX-512 F/BW/VNNI, "avx2" with AVX2 + FMA + F16C, "generic" otherwise."""
    name = os.environ.get("ACTORSERVE_ISA", "").strip().lower()
    if name:
        if name not in ISA_FLAGS:
            raise ValueError(f"ACTORSERVE_ISA={name!r}: expected one of {sorted(ISA_FLAGS)}")
        return name
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "generic"


def _kernel_dir() -> Path:
    return Path(os.environ.get("ACTORSERVE_KERNEL_DIR") or Path.home() / ".cache" / "actorserve" / "kernels")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(so: Path) -> bool:
    """True if ``so`` and its ``.sha256`` sidecar exist and agree.  A truncated or rewritten library
    must never reach ``dlopen``: mapping a cut ELF file can end the process with SIGBUS, not an
    exception."""
    side = so.with_suffix(".sha256")
    try:
        return side.read_text().strip() == _digest(so)
    except OSError:
        return False


def _remove_stale_temps(folder: Path, older_than_s: float = 3600.0) -> None:
    """Temporary outputs of builds that were killed (an hour old or more)."""
    now = time.time()
    for tmp in folder.glob("*.tmp"):
        try:
            if now - tmp.stat().st_mtime > older_than_s:
                tmp.unlink()
        except OSError:
            pass


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build(cxx: list[str], isa: str = "avx512") -> Path:
    """Compile SOURCES into one library (``ISA_FLAGS[isa]`` added) unless a verified build is cached;
    return the shared object's path.

    Raises OSError (unwritable folder, empty or non-ELF output) or subprocess errors (compiler
    missing, failing or over ``BUILD_TIMEOUT_S``)."""
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = [*FLAGS, *ISA_FLAGS[isa]]
    key = hashlib.sha256("\0".join([*(src.read_text() for src in [*SOURCES, *HEADERS]), *flags, *LIBS, version, " ".join(sorted(cpu_flags()))])
                         .encode()).hexdigest()[:16]
    out = _kernel_dir() / f"cpu_kernels-{key}.so"
    if _verified(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out.parent)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([*cxx, *flags, "-o", tmp, *map(str, SOURCES), *LIBS], check=True, capture_output=True, text=True,
                       timeout=BUILD_TIMEOUT_S)
        data = Path(tmp).read_bytes()
        if not data.startswith(b"\x7fELF"):
            raise OSError(f"{' '.join(cxx)} wrote no shared object ({len(data)} bytes)")
        _write_atomic(out.with_suffix(".sha256"), hashlib.sha256(data).hexdigest().encode())
        _write_atomic(out, data)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _open(cxx: list[str], isa: str) -> ctypes.CDLL:
    """Build (or reuse) and load the library; a verified file that still does not load (built for
    another machine with the same key) is removed and built once more.  Raises OSError / SubprocessError."""
    path = _build(cxx, isa)
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("cached CPU kernels %s did not load (%s); rebuilding", path, exc)
        path.with_suffix(".sha256").unlink(missing_ok=True)
        return ctypes.CDLL(str(_build(cxx, isa)))


@functools.lru_cache(maxsize=1)
def load() -> "CpuKernels | None":
    """The compiled kernel for ``select_isa()``, or None where it cannot be built (logged once)."""
    if os.environ.get("ACTORSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    return _load(select_isa())


@functools.lru_cache(maxsize=4)
def load_isa(isa: str) -> "CpuKernels | None":
    """The kernels built for ``isa`` (a key of ``ISA_FLAGS``) whatever the environment says, or None
    where they cannot be built; for tests and measurements of the narrower paths."""
    return _load(isa)


def _load(isa: str) -> "CpuKernels | None":
    cxx = shlex.split(os.environ.get("CXX", "")) or [c for c in (shutil.which("g++") or shutil.which("c++"),) if c]
    if not cxx:
        log.warning("no C++ compiler: the engine's CPU kernels stay on the PyTorch path")
        return None
    try:
        return CpuKernels(_open(cxx, isa))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native CPU kernels unavailable (%s); using the PyTorch path", str(detail)[:500])
        return None


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"cpu kernel: {what}")


class CpuKernels:
    """ctypes wrappers of csrc/cpu_kernels.cpp.  Every tensor is a CPU tensor of one dtype (float32 or
    bfloat16, ``supports``); each method raises ValueError on a layout or dtype it cannot read."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        sigs = {
            "actorserve_paged_decode_attention": [i32, p, i64, p, i64, p, p, p, p, i64, p, i32, i32, i32, i32, i32, f32,
                                                  i32, f32],
            "actorserve_add_rms_norm": [i32, p, p, p, p, i64, i32, f32],
            "actorserve_rope_kv": [i32, p, i64, i64, i32, i32, i32, p, p, p, p, p, p],
            "actorserve_silu_mul": [i32, p, p, i64, i32],
            "actorserve_int4_linear": [p, i64, p, p, p, i64, i32, i32, i32, i32],
            "actorserve_amx_available": [],
            "actorserve_prefill_attention": [p, i64, p, p, i64, p, i64, i32, i32, i32, i32, f32],
            "actorserve_qgemm": [i32, i32, p, i64, p, p, i64, i32, i32, i32],
            "actorserve_qgemm_isa": [],
            "actorserve_lora_sgmv": [i32, p, i64, p, p, p, i64, p, i64, i32, i32, i32, i32, i32, i32, p],
            "actorserve_decode_layers": [i32, p, i32, p, p],  # whole_step.py: every layer of a small decode step
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, i32
            setattr(self, "_" + name.removeprefix("actorserve_"), fn)
        self.has_amx = self._amx_available() == 1  # built with AMX-BF16 and the kernel granted tile data
        self.qgemm_isa = QGEMM_ISAS[self._qgemm_isa()]  # the integer-product path this build runs

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device | str) -> bool:
        """True for CPU tensors of float32 or bfloat16."""
        return torch.device(device).type == "cpu" and dtype in _DTYPE_CODES

    @staticmethod
    def _rc(rc: int, name: str) -> None:
        _check(rc == 0, f"{name} refused its shapes (code {rc})")

    def paged_decode_attention(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, rows: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> None:
        """Attention of the 1-token queries ``q[rows]`` into ``out[rows]``, K/V read in place.

        q, out: [T, H, hd] (row-strided, heads contiguous), the cache's dtype.  k_cache, v_cache:
        [num_blocks, block_size, Hkv, hd] contiguous.  rows, context_lens: int32 [S]; block_tables:
        int32 [S, max_blocks] contiguous.  ``scale``: softmax temperature (1/sqrt(hd) as SDPA).  ``window``
        (tokens, 0 = none): sliding-window attention, a query of context n sees keys n - window .. n - 1.
        ``softcap`` (> 0): scaled scores become ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2's
        attention soft-capping); 0 = none.
        """
        T, H, hd = q.shape
        _, bs, Hkv, hd_k = k_cache.shape
        _check(hd_k == hd and q.dtype == k_cache.dtype == out.dtype, "attention: dtype or head_dim mismatch")
        _check(q.stride(2) == 1 and q.stride(1) == hd and out.stride(2) == 1 and out.stride(1) == hd,
               "attention: q/out heads must be contiguous")
        _check(k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous(),
               "attention: caches and block tables must be contiguous")
        _check(rows.dtype == block_tables.dtype == context_lens.dtype == torch.int32, "attention: int32 indices")
        self._rc(self._paged_decode_attention(
            _DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(), rows.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
            context_lens.data_ptr(), rows.numel(), H, Hkv, hd, bs, scale, window, softcap), "attention")

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``h += delta`` in place (when given), then RMSNorm of h -> new tensor; h, delta [rows, d]."""
        _check(h.dim() == 2 and h.is_contiguous() and weight.is_contiguous() and weight.dtype == h.dtype,
               "rms_norm: h [rows, d] and weight contiguous, one dtype")
        _check(delta is None or (delta.shape == h.shape and delta.is_contiguous() and delta.dtype == h.dtype),
               "rms_norm: delta like h")
        out = torch.empty_like(h)
        self._rc(self._add_rms_norm(_DTYPE_CODES[h.dtype], h.data_ptr(), None if delta is None else delta.data_ptr(),
                                    weight.data_ptr(), out.data_ptr(), h.shape[0], h.shape[1], eps), "rms_norm")
        return out

    def rope_kv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> None:
        """Rotate the Q and K heads of ``qkv`` [T, (H + 2 Hkv) hd] in place and write K, V to their slots.

        positions, slot_mapping: int64 [T]; cos, sin: float32 [max_pos, hd] contiguous; caches
        [num_blocks, block_size, Hkv, hd] contiguous (a slot is block * block_size + offset).
        """
        _check(qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim,
               "rope: qkv [T, (H + 2 Hkv) hd] with contiguous rows")
        _check(positions.dtype == slot_mapping.dtype == torch.int64 and positions.is_contiguous()
               and slot_mapping.is_contiguous(), "rope: int64 positions and slots")
        _check(cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous(),
               "rope: float32 tables")
        _check(k_cache.dtype == v_cache.dtype == qkv.dtype and k_cache.is_contiguous() and v_cache.is_contiguous(),
               "rope: caches contiguous, qkv's dtype")
        self._rc(self._rope_kv(_DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_heads,
                               num_kv_heads, head_dim, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                               slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()), "rope")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: ``silu(g) * u`` for ``gate_up`` [rows, 2f] = [g | u] -> [rows, f]."""
        _check(gate_up.dim() == 2 and gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0,
               "silu_mul: gate_up [rows, 2f] contiguous")
        rows, f = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, f, dtype=gate_up.dtype)
        self._rc(self._silu_mul(_DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), rows, f), "silu_mul")
        return out

    def int4_linear(self, x: torch.Tensor, qweight: torch.Tensor, scale_zeros: torch.Tensor, out: torch.Tensor,
                    swiglu: bool = False) -> None:
        """``out = x @ W^T`` for the int4 weight packed by ``quant.pack_int4_amx`` (needs ``has_amx``).

        x [M, K] and out [M, N] (``swiglu``: [M, N / 2] = silu(gate) * up, W's rows in strips of 16
        gate rows then the 16 matching up rows): bfloat16 with contiguous rows (any row stride);
        qweight uint8 [N/16, K/32, 16, 16]; scale_zeros bfloat16 [N/16, K/32, 2, 16].  Raises
        ValueError on other layouts, N % 16 (swiglu: 32) or K % 32 != 0, K > 16384, or without AMX."""
        _check(x.dim() == 2 and out.dim() == 2, "int4_linear: x [M, K] and out [M, N] must be 2-D")
        M, K = x.shape
        N = out.shape[1] * (2 if swiglu else 1)
        _check(self.has_amx, "int4_linear: this CPU or build has no AMX-BF16")
        _check(x.dtype == out.dtype == scale_zeros.dtype == torch.bfloat16 and qweight.dtype == torch.uint8,
               "int4_linear: bf16 x/out/scales, uint8 weight")
        _check(x.stride(1) == 1 and out.stride(1) == 1 and out.shape[0] == M, "int4_linear: x [M, K], out [M, N] rows")
        _check(qweight.shape == (N // 16, K // 32, 16, 16) and scale_zeros.shape == (N // 16, K // 32, 2, 16)
               and qweight.is_contiguous() and scale_zeros.is_contiguous(), "int4_linear: packed weight shape")
        self._rc(self._int4_linear(x.data_ptr(), x.stride(0), qweight.data_ptr(), scale_zeros.data_ptr(),
                                   out.data_ptr(), out.stride(0), M, N, K, int(swiglu)), "int4_linear")

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of a fresh chunk (no cached prefix) on AMX; needs ``has_amx``.

        q [n, H, 64], k/v [n, Hkv, 64]: bfloat16, heads contiguous, any row stride (views of the
        fused QKV output).  Returns [n, H, 64] bfloat16.  Raises ValueError on other layouts."""
        _check(q.dim() == k.dim() == v.dim() == 3, "prefill_attention: q [n, H, 64], k/v [n, Hkv, 64]")
        n, H, hd = q.shape
        Hkv = k.shape[1]
        _check(self.has_amx, "prefill_attention: this CPU or build has no AMX-BF16")
        _check(Hkv > 0 and n > 0, "prefill_attention: no tokens or no KV heads")
        _check(q.dtype == k.dtype == v.dtype == torch.bfloat16 and hd == 64 and k.shape == v.shape == (n, Hkv, hd)
               and H % Hkv == 0, "prefill_attention: bf16 q [n, H, 64], k/v [n, Hkv, 64]")
        _check(all(t.stride(2) == 1 and t.stride(1) == hd for t in (q, k, v)) and k.stride(0) == v.stride(0),
               "prefill_attention: heads contiguous, one row stride for k and v")
        out = torch.empty(n, H, hd, dtype=torch.bfloat16)
        self._rc(self._prefill_attention(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0),
                                         out.data_ptr(), out.stride(0), n, H, Hkv, hd, scale), "prefill_attention")
        return out

    def qgemm(self, x: torch.Tensor, packed: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
        """``y = x @ W^T`` for a block-quantized weight packed by ``quant.pack_blocks``.

        x [M, K] float32 or bfloat16 with contiguous rows (any row stride); packed uint8
        [N / 16, K / 32, 544] (bits 8) or [N / 16, K / 32, 320] (bits 4), N = ``out_features``.
        Returns y [M, N] in x's dtype.  x is quantized per row and 32-block to int8 inside (the
        exact arithmetic: csrc/qgemm.cpp).  Raises ValueError on other layouts or dtypes."""
        _check(x.dim() == 2 and x.stride(1) == 1 and x.dtype in _DTYPE_CODES, "qgemm: x [M, K] float32/bf16 rows")
        M, K = x.shape
        bs = {8: 544, 4: 320}.get(bits)
        _check(bs is not None and packed.dtype == torch.uint8 and packed.is_contiguous()
               and packed.shape == (out_features // 16, K // 32, bs) and out_features % 16 == 0 and K % 32 == 0,
               f"qgemm: packed weight for bits {bits}, [{out_features}, {K}]")
        out = torch.empty(M, out_features, dtype=x.dtype)
        self._rc(self._qgemm(_DTYPE_CODES[x.dtype], bits, x.data_ptr(), x.stride(0), packed.data_ptr(),
                             out.data_ptr(), out.stride(0), M, out_features, K), "qgemm")
        return out


    def qgemm_bound(self, packed: torch.Tensor, bits: int, out_features: int):
        """``fn(x) -> y``: ``qgemm`` over one packed weight, whose checks run once here instead of at every call
        (a decode step makes four products a layer: at one row the checks, the dict lookups and the argument
        conversions were a third of a small product's ~14 us).  x as ``qgemm``'s, its K the weight's; the
        callable holds ``packed``.  ValueError here on a bad pack, in the call on a bad x."""
        bs = {8: 544, 4: 320}.get(bits)
        _check(bs is not None and packed.dtype == torch.uint8 and packed.is_contiguous() and packed.dim() == 3
               and packed.shape[0] * 16 == out_features and packed.shape[2] == bs,
               f"qgemm: packed weight for bits {bits}, {out_features} outputs")
        K, w_ptr, codes, rc, kernels = packed.shape[1] * 32, packed.data_ptr(), _DTYPE_CODES, self._rc, self
        empty = torch.empty

        def product(x: torch.Tensor) -> torch.Tensor:
            code = codes.get(x.dtype)
            if code is None or x.dim() != 2 or x.shape[1] != K or x.stride(1) != 1:
                raise ValueError(f"cpu kernel: qgemm: x [M, {K}] float32/bf16 rows, got {tuple(x.shape)} {x.dtype}")
            M = x.shape[0]
            out = empty(M, out_features, dtype=x.dtype)
            rc(kernels._qgemm(code, bits, x.data_ptr(), x.stride(0), w_ptr, out.data_ptr(), out_features, M,
                              out_features, K), "qgemm")  # looked up per call: the native entry tests can wrap
            return out

        product.packed = packed  # keeps the weight alive with the pointer
        return product


def lora_sgmv(kernels: "CpuKernels", x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor,
              slot: torch.Tensor, r_max: int, cols: torch.Tensor) -> None:
    """``y[t] += (x[t] @ a[slot[t]]) @ b[slot[t]]`` for rows with ``slot[t] >= 0`` (csrc/lora_sgmv.cpp).

    x [T, in], y [T, out]: contiguous rows, one dtype with a [S, in, R] and b [S, R, out] (contiguous; b
    block-diagonal by sub-projection: rank rows [i r_max, (i+1) r_max) only in columns [cols[i], cols[i+1]));
    slot int32 [T]; cols int32 [n_sub + 1]. ValueError on other layouts."""
    T, n_in = x.shape
    S, _, R = a.shape
    out, n_sub = y.shape[1], cols.numel() - 1
    _check(x.dtype == y.dtype == a.dtype == b.dtype and x.dtype in _DTYPE_CODES, "lora_sgmv: one float dtype")
    _check(x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
           and a.shape[1] == n_in and b.shape == (S, R, out) and y.shape[0] == T, "lora_sgmv: shapes")
    _check(slot.dtype == cols.dtype == torch.int32 and slot.numel() == T and R == n_sub * r_max, "lora_sgmv: indices")
    kernels._rc(kernels._lora_sgmv(_DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), a.data_ptr(), b.data_ptr(),
                                   y.data_ptr(), y.stride(0), slot.data_ptr(), T, S, n_in, R, out, n_sub, r_max,
                                   cols.data_ptr()), "lora_sgmv")
