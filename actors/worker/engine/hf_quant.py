"""Hugging Face directories whose projections arrive quantized (issue [23] items 2-3): GPTQ, AWQ (GEMM) and FP8.

``config.json``'s ``quantization_config`` names the method (``quant_spec``); anything else there, or a value this
module does not read (bits other than 4, AWQ other than GEMM with zero points, an unknown FP8 layout), refuses
the directory naming the field (arch_spec.UnsupportedModel).  The loader (hf_loader.load_hf) gets each
projection as the float32 weight the checkpoint means (``dequantize``), converted to the engine dtype; the
engine's factory (kquant.file_precision_factory over ``HFInt4``) then holds GPTQ / AWQ projections whose
grouping allows it as the engine's int4 groups of 32 with the checkpoint's own integers, and the rest dense.

Packing (read from the sources; our own code):

* GPTQ (AutoGPTQ ``nn_modules/qlinear/qlinear_cuda_old.py`` ``QuantLinear.pack`` / its torch dequantization; the
  same layout in gptqmodel): ``qweight`` int32 [in / 8, out], input row 8 i + k in bits 4k..4k+3 of word row i;
  ``qzeros`` int32 [groups, out / 8], output column 8 j + k in bits 4k.. of word column j; ``scales`` float16
  [groups, out]; ``g_idx`` int32 [in]: the group of each input (``i // group_size`` unless ``desc_act``
  reordered them).  ``w[o, i] = scales[g, o] * (q[i, o] - zero[g, o])`` with ``g = g_idx[i]``.  Format v1
  (``checkpoint_format`` "gptq", the default and what AutoGPTQ writes) stores ``zero - 1`` ("zeros -= 1" before
  packing, "+ 1" when unpacking); gptqmodel's "gptq_v2" stores the zero itself.
* AWQ GEMM (AutoAWQ ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear``): ``qweight`` int32
  [in, out / 8] and ``qzeros`` int32 [groups, out / 8], both packing along the output with the interleave
  ``[0, 2, 4, 6, 1, 3, 5, 7]``: bits 4k.. of word column j hold column 8 j + order[k]; ``scales`` float16
  [groups, out]; ``w = (q - zero) * scale`` (input i in group ``i // group_size``).
* FP8 (``float8_e4m3fn`` weights): compressed-tensors (``quant_method`` "compressed-tensors", format
  "float-quantized" / "naive-quantized", weights ``type`` float with 8 bits, strategy "tensor" or "channel":
  ``weight_scale`` [1] or [out, 1]) or the plain ``quant_method`` "fp8" (``weight_scale_inv`` per block of
  ``weight_block_size``, or a per-tensor / per-channel ``weight_scale``): ``w = fp8 * scale``.  An
  ``input_scale`` (static activation scale) is read and not applied: activations stay in the engine dtype.

Exactness: ``scale * (q - zero)`` of a half scale and an integer below 32 in magnitude has at most 16
significant bits, so the float32 weight is exact (no rounding); an FP8 value (4 bits) times a float32 scale is
exact when the scale is a half or bfloat16, else rounded once.  The engine's int4 form ``(q - 8) s + z`` with
``s = scale`` and ``z = (8 - zero) scale`` holds the same values (kquant.int4_linear: float32 bit for bit;
bfloat16: scale and zero rounded once).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .arch_spec import UnsupportedModel

PROJ_MODULES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order of 8 output columns in one int32
_SUFFIXES = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
             "fp8": ("weight", "weight_scale", "weight_scale_inv", "input_scale")}
_FUSED = {"qkv": ("wq", "wk", "wv"), "o": ("wo",), "gate_up": ("w_gate", "w_up"), "down": ("w_down",)}


class QuantSpec:
    """``method`` ("gptq" | "awq" | "fp8"), ``bits``, ``group_size`` (inputs per group; -1: one per row),
    ``desc_act``, ``v1`` (GPTQ zeros stored minus one), ``block`` (FP8 ``weight_block_size`` or None),
    ``label`` (what the start-up line and ``status`` call it)."""

    def __init__(self, method: str, bits: int = 4, group_size: int = -1, desc_act: bool = False, v1: bool = True,
                 block: tuple[int, int] | None = None) -> None:
        self.method, self.bits, self.group_size, self.desc_act, self.v1, self.block = (
            method, bits, group_size, desc_act, v1, block)
        self.label = {"gptq": "GPTQ", "awq": "AWQ", "fp8": "FP8"}[method]


def quant_spec(cfg: dict) -> QuantSpec | None:
    """The ``QuantSpec`` of a parsed ``config.json`` (None without ``quantization_config``).  UnsupportedModel
    names the field of a method or value not read here."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedModel("config.json: quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method in ("gptq", "awq"):
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise UnsupportedModel(f"config.json: quantization_config.bits {bits!r} is not supported ({method}: 4 only)")
        group = int(qc.get("group_size", qc.get("q_group_size", -1)))
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise UnsupportedModel(f"config.json: quantization_config.version {version!r} is not supported "
                                       "(AWQ: gemm only)")
            if not qc.get("zero_point", True):
                raise UnsupportedModel("config.json: quantization_config.zero_point false is not supported (AWQ)")
            return QuantSpec("awq", 4, group)
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedModel(f"config.json: quantization_config.checkpoint_format {fmt!r} is not supported "
                                   "(gptq, gptq_v2)")
        return QuantSpec("gptq", 4, group, bool(qc.get("desc_act", False)), v1=fmt == "gptq")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or len(block) != 2):
            raise UnsupportedModel(f"config.json: quantization_config.weight_block_size {block!r} is not [rows, cols]")
        return QuantSpec("fp8", 8, block=tuple(int(b) for b in block) if block else None)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise UnsupportedModel(f"config.json: quantization_config.quant_method {method!r} is not supported "
                           "(gptq, awq, fp8, compressed-tensors)")


def _compressed_tensors(qc: dict) -> QuantSpec:
    """compressed-tensors: FP8 weights (float, 8 bits, strategy tensor or channel) only."""
    fmt = str(qc.get("format", ""))
    if fmt not in ("float-quantized", "naive-quantized"):
        raise UnsupportedModel(f"config.json: quantization_config.format {fmt!r} is not supported (compressed-tensors: "
                               "float-quantized, naive-quantized)")
    for name, group in (qc.get("config_groups") or {}).items():
        w = (group or {}).get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in ("tensor", "channel"):
            raise UnsupportedModel(f"config.json: quantization_config.config_groups.{name}.weights {w!r} is not "
                                   "supported (FP8: type float, num_bits 8, strategy tensor or channel)")
    return QuantSpec("fp8", 8)


def spec_of_dir(path: str) -> QuantSpec | None:
    """``quant_spec`` of the directory's config.json (None when it has none or cannot be read)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return quant_spec(cfg)


# ------------------------------------------------------------------------------------ unpacking


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [r / 8, c] -> int32 [r, c]: row 8 i + k from bits 4k..4k+3 of word row i (GPTQ ``qweight``)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.unsqueeze(1) >> shifts[None, :, None]) & 15).reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int32 [r, c / 8] -> int32 [r, c]: column 8 j + order[k] from bits 4k.. of word column j (GPTQ ``qzeros``:
    order 0..7; AWQ: ``AWQ_ORDER``)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nib = (packed.unsqueeze(-1) >> shifts) & 15  # [r, c / 8, k]
    out = torch.empty_like(nib)
    out[..., list(order)] = nib
    return out.reshape(packed.shape[0], -1)


def unpacked(spec: QuantSpec, t: dict[str, torch.Tensor], in_features: int):
    """(q int32 [out, in], zero int32 [groups, out], scale float32 [groups, out], g int64 [in]) of one GPTQ /
    AWQ projection's tensors ``t`` (qweight, qzeros, scales, g_idx).  UnsupportedModel for shapes that do not
    fit the layout."""
    qw, qz, sc = t["qweight"], t["qzeros"], t["scales"].float()
    if spec.method == "gptq":
        q = unpack_rows(qw).t()
        zero = unpack_cols(qz) + (1 if spec.v1 else 0)
        g = t["g_idx"].long() if "g_idx" in t else None
    else:
        q = unpack_cols(qw, AWQ_ORDER).t()
        zero = unpack_cols(qz, AWQ_ORDER)
        g = None
    groups = sc.shape[0]
    if g is None:
        size = spec.group_size if spec.group_size > 0 else in_features
        g = torch.arange(in_features) // size
    if q.shape[1] != in_features or zero.shape != sc.shape or g.shape != (in_features,) or int(g.max()) >= groups:
        raise UnsupportedModel(f"{spec.label} tensors qweight {list(qw.shape)}, qzeros {list(qz.shape)}, scales "
                               f"{list(sc.shape)} do not fit {in_features} inputs")
    return q.contiguous(), zero, sc, g


def dequantize_int4(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] ``scale[g[i], o] * (q[o, i] - zero[g[i], o])`` (exact: module docstring)."""
    return scale[g].t() * (q - zero[g].t()).float()


def dequantize_fp8(spec: QuantSpec, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """float32 [out, in] of an FP8 projection: ``weight`` times ``weight_scale`` (per tensor or per output row)
    or ``weight_scale_inv`` (per ``spec.block`` block).  UnsupportedModel for another weight dtype or scale shape."""
    w = t["weight"]
    if w.dtype in (torch.float32, torch.float16, torch.bfloat16) and not ({"weight_scale", "weight_scale_inv"} & set(t)):
        return w.float()  # a projection the checkpoint left unquantized (compressed-tensors ``ignore``)
    if w.dtype != torch.float8_e4m3fn:
        raise UnsupportedModel(f"FP8 weight of dtype {w.dtype} (float8_e4m3fn only)")
    wf = w.float()
    out_f, in_f = wf.shape
    if "weight_scale_inv" in t:
        s = t["weight_scale_inv"].float()
        b0, b1 = spec.block or (128, 128)
        if s.shape != (-(-out_f // b0), -(-in_f // b1)):
            raise UnsupportedModel(f"FP8 weight_scale_inv {list(s.shape)} does not cover {out_f}x{in_f} in blocks "
                                   f"of {b0}x{b1}")
        return wf * s.repeat_interleave(b0, 0)[:out_f].repeat_interleave(b1, 1)[:, :in_f]
    if "weight_scale" not in t:
        raise UnsupportedModel("FP8 weight without weight_scale")
    s = t["weight_scale"].float()
    if s.numel() == 1:
        return wf * s.reshape(())
    if s.numel() == out_f:
        return wf * s.reshape(out_f, 1)
    raise UnsupportedModel(f"FP8 weight_scale {list(s.shape)} is neither per tensor nor per output row ({out_f})")


def int4_groups(q, zero, scale, g, group: int = 32):
    """(q uint8 [out, in], scale, mn float32 [out, in / 32]) with ``w = q * scale - mn`` per 32 inputs
    (kquant's form, ``mn = zero * scale`` exact), or None when 32 consecutive inputs do not share one group
    (a ``desc_act`` order, groups of 16) or an integer is outside 0..15."""
    in_f = q.shape[1]
    if in_f % group or int(q.min()) < 0 or int(q.max()) > 15:
        return None
    chunks = g.reshape(-1, group)
    if not bool((chunks == chunks[:, :1]).all()):
        return None
    gi = chunks[:, 0]
    s = scale[gi].t().contiguous()
    return q.to(torch.uint8), s, (zero[gi].t().float() * s).contiguous()


# ------------------------------------------------------------------------------------ the directory


def split_name(name: str, spec: QuantSpec) -> tuple[str, str] | None:
    """(module, suffix) of a tensor of a quantized projection (``model.layers.0.self_attn.q_proj.qweight``), else
    None."""
    module, _, suffix = name.rpartition(".")
    if suffix in _SUFFIXES[spec.method] and module.split(".", 3)[-1] in PROJ_MODULES.values():
        return module, suffix
    return None


def read_module(files: dict[str, tuple[Path, str]]) -> dict[str, torch.Tensor]:
    """{suffix: tensor} of one quantized module from ``{suffix: (shard file, tensor name)}``."""
    from safetensors import safe_open

    out = {}
    for suffix, (file, name) in files.items():
        with safe_open(str(file), framework="pt") as f:
            out[suffix] = f.get_tensor(name)
    return out


def account(path: str, config, spec: QuantSpec, loader):
    """(where, quantized): ``where`` {our name: (shard, HF name)} of the plain tensors and ``quantized`` {our
    name: {suffix: (shard, HF name)}} of the projections, checked against the spec (arch_spec.check_tensors,
    with each projection's dequantized shape).  ``loader``: the hf_loader module (its names and shards; passed,
    not imported: hf_loader calls this module).  Reads headers only; UnsupportedModel names what does not fit."""
    from safetensors import safe_open

    from .arch_spec import check_tensors

    _DERIVED, hf_name, our_name, shard_files = loader._DERIVED, loader.hf_name, loader.our_name, loader.shard_files

    where, quantized, found, shapes = {}, {}, {}, {}
    for file in shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_DERIVED):
                    continue
                split = split_name(name, spec)
                if split is not None:
                    module, suffix = split
                    ours = our_name(module + ".weight")
                    quantized.setdefault(ours, {})[suffix] = (file, name)
                    shapes.setdefault(ours, {})[suffix] = tuple(f.get_slice(name).get_shape())
                    continue
                ours = our_name(name)
                if ours is None:
                    raise UnsupportedModel(f"{path}: unknown tensor {name!r} in {file.name} (not a "
                                           f"{config.architecture} weight)")
                where[ours] = (file, name)
                found[ours] = (tuple(f.get_slice(name).get_shape()), name)
    for ours, sh in shapes.items():
        found[ours] = (_dequantized_shape(spec, sh, hf_name(ours)), hf_name(ours))
    check_tensors(config, found, path, hf_name)
    return where, quantized


def _dequantized_shape(spec: QuantSpec, sh: dict[str, tuple], name: str) -> tuple[int, int]:
    """[out, in] of a quantized projection from its tensors' shapes."""
    if spec.method == "fp8":
        if "weight" not in sh:
            raise UnsupportedModel(f"{name}: FP8 projection without its weight")
        return sh["weight"]
    if "qweight" not in sh:
        raise UnsupportedModel(f"{name}: {spec.label} projection without qweight")
    r, c = sh["qweight"]
    return (c, r * 8) if spec.method == "gptq" else (c * 8, r)


def load(path: str, config, spec: QuantSpec, dtype: torch.dtype, device: str, loader) -> dict[str, torch.Tensor]:
    """The directory's weights (names of hf_loader.load_hf), projections dequantized (``projection_weight``)
    then converted to ``dtype``."""
    from safetensors import safe_open

    where, quantized = account(path, config, spec, loader)
    weights = {}
    for ours, (file, name) in where.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            weights[ours] = f.get_tensor(name).to(device=device, dtype=dtype)
    in_features = _in_features(config)
    for ours, files in quantized.items():
        w = projection_weight(spec, read_module(files), in_features[ours.rsplit(".", 1)[1]])
        weights[ours] = w.to(device=device, dtype=dtype)
    weights.setdefault("lm_head", weights["embed"])
    return weights


def _in_features(config) -> dict[str, int]:
    """Input features of each projection (our short names)."""
    d, q = config.hidden_size, config.num_heads * config.head_dim
    return {"wq": d, "wk": d, "wv": d, "wo": q, "w_gate": d, "w_up": d, "w_down": config.ffn_size}


def projection_weight(spec: QuantSpec, t: dict[str, torch.Tensor], in_features: int) -> torch.Tensor:
    """float32 [out, in] of one projection's tensors (module docstring)."""
    if spec.method == "fp8":
        return dequantize_fp8(spec, t)
    missing = [s for s in ("qweight", "qzeros", "scales") if s not in t]
    if missing:
        raise UnsupportedModel(f"{spec.label} projection without {missing[0]}")
    return dequantize_int4(*unpacked(spec, t, in_features))


class HFInt4:
    """kquant's source of int4 parts for a GPTQ / AWQ / FP8 directory (the interface of ``kquant.FileInt4``):
    ``types(layer, proj)``: per part the method's label ("GPTQ", "AWQ") where 32 consecutive inputs share one
    group, else "GPTQ g_idx" / "AWQ groups" (held dense); "FP8" for FP8; ``parts(layer, proj)``."""

    def __init__(self, path: str, config, spec: QuantSpec, loader) -> None:
        self.spec, self.in_features = spec, _in_features(config)
        self.quantized = account(path, config, spec, loader)[1]
        self._cache: dict[tuple[int, str], list] = {}

    def _groups(self, layer: int, proj: str) -> list:
        key = (layer, proj)
        if key not in self._cache:
            out = []
            for short in _FUSED[proj]:
                t = read_module(self.quantized[f"layers.{layer}.{short}"])
                out.append(int4_groups(*unpacked(self.spec, t, self.in_features[short])))
            self._cache = {key: out}  # one projection at a time
        return self._cache[key]

    def types(self, layer: int, proj: str) -> list[str]:
        """The label of each part of fused projection ``proj`` of ``layer`` (class docstring)."""
        if self.spec.method == "fp8":
            return ["FP8"] * len(_FUSED[proj])
        other = "g_idx" if self.spec.method == "gptq" else "groups"
        return [self.spec.label if p is not None else f"{self.spec.label} {other}" for p in self._groups(layer, proj)]

    def parts(self, layer: int, proj: str):
        """(q uint8 [out, in], scale, mn float32 [out, in / 32]) of the fused projection (parts stacked by rows);
        only where every part's ``types`` is the method's label."""
        ps = self._groups(layer, proj)
        return tuple(torch.cat([p[i] for p in ps]) for i in range(3))
