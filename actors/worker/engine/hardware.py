"""Hardware capability checks for the engine: CPU flags, bf16 matmul support, dtype resolution.

The worker's default path (dtype and quantization together) is chosen by ``kernel_choice.py`` from
``isa_flags()``; ``resolve_dtype`` is the engine's own fallback for ``EngineConfig(dtype="auto")``.

``dtype="auto"`` resolves to bfloat16 where the device multiplies bf16 matrices natively (CPU:
AMX-BF16 or AVX512-BF16 through oneDNN; CUDA: compute capability >= 8.0), else float32.
Measured on a 2-core Sapphire Rapids VM (docs/decisions/0006-engine-speed.md): a 4096^3 product runs
at ~900 GFLOP/s in bf16 against ~150 in fp32.
"""

from __future__ import annotations

import functools

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (empty where unavailable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa_flags() -> frozenset[str]:
    """The CPU flags the engine's path choice depends on (``kernel_policy.ISA_FLAGS``) present here."""
    from .kernel_policy import ISA_FLAGS

    return cpu_flags() & frozenset(ISA_FLAGS)


def bf16_matmul_supported(device: str) -> bool:
    """True where bf16 matrix products run on native units (not emulated)."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if not torch.backends.mkldnn.is_available():
        return False
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def resolve_dtype(name: str, device: str) -> str:
    """``"auto"`` -> ``"bfloat16"`` where supported else ``"float32"``; other names unchanged."""
    if name == "auto":
        return "bfloat16" if bf16_matmul_supported(device) else "float32"
    return name
