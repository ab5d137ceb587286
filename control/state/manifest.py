"""The model manifest: the validated record of one model version in etcd (pure: no I/O).

Stored at ``/actorserve/models/{name}/versions/{version}`` by ``Registry.put_model_version``; the
``actorserve models register`` verb builds one (docs/models.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from bus.messages import REASONING_FORMATS, TOOL_CALL_FORMATS, sampling_defaults
from control.state import names
from control.policy.numbers import is_number

SUPPORTED_FORMATS = ("gguf", "hf")  # hf: a Hugging Face directory (config.json + safetensors; engine/hf_loader.py)
SUPPORTED_TOKENIZERS = ("gguf", "hf")  # the GGUF's vocabulary, or the directory's tokenizer.json
MANIFEST_STATUSES = ("active", "disabled", "retired")
PRICING_FIELDS = ("prompt_per_1m", "completion_per_1m")  # USD per 1M tokens (docs/budgets.md)
MAX_PRICE_PER_1M = 1_000_000.0  # USD per 1M tokens: a sanity cap (1 USD per token)
NO_REASONING = "none"  # reasoning_format: the model's output is never split (inference from the template off)


def check_pricing(value: Any) -> dict[str, float] | None:
    """The validated ``pricing`` of a manifest: None (free) or ``{"prompt_per_1m": USD, "completion_per_1m":
    USD}``, USD per 1M prompt / completion tokens, each a finite number 0..MAX_PRICE_PER_1M. ValueError naming
    the field (``pricing.prompt_per_1m``) otherwise."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"pricing must be an object with {' and '.join(PRICING_FIELDS)} or null, got {value!r}")
    unknown = sorted(set(value) - set(PRICING_FIELDS))
    if unknown:
        raise ValueError(f"pricing.{unknown[0]} is not a pricing field (known: {', '.join(PRICING_FIELDS)})")
    out = {}
    for k in PRICING_FIELDS:
        v = value.get(k)
        if not is_number(v) or not 0 <= v <= MAX_PRICE_PER_1M:
            raise ValueError(f"pricing.{k} must be a number of USD per 1M tokens between 0 and "
                             f"{MAX_PRICE_PER_1M:g}, got {v!r}")
        out[k] = float(v)
    return out


def infer_format(artifact: str) -> str:
    """The format a path names, by its spelling alone (the manifest does no I/O): ``hf`` for a directory path
    written with a trailing ``/``, else ``gguf`` (the default it always had). ``format`` given explicitly wins."""
    return "hf" if artifact.endswith("/") else "gguf"


@dataclass(frozen=True)
class ModelManifest:
    """Manifest of one model version, stored at ``/actorserve/models/{name}/versions/{version}``.

    Validated on construction; every problem raises ValueError naming the field.

    * ``artifact``: path of the weights file (non-empty string).
    * ``format``: ``"gguf"`` or ``"hf"`` (a Hugging Face directory); others raise
      ``ValueError("format X is not supported yet (supported: gguf, hf)")``. ``from_dict`` without one infers
      it from the path (``infer_format``).
    * ``context_length``: max tokens (prompt + completion), positive int, or None (from the artifact).
    * ``memory_bytes``: memory the weights need, in bytes, non-negative int or None (unknown).
    * ``tokenizer``: ``"gguf"`` (the GGUF's vocabulary) or ``"hf"`` (the directory's ``tokenizer.json``); both are
      read from the artifact (actors/text/loader.py picks by the path).
    * ``chat_template``: ``"gguf"`` (from the artifact) or an inline Jinja template string.
    * ``defaults``: sampling defaults the validator applies where a request is silent (request >
      manifest > server default): ``bus.messages.MANIFEST_DEFAULTABLE`` (temperature, top_p, top_k, seed,
      max_tokens, stop, frequency_penalty, presence_penalty, min_p, repetition_penalty), each checked like
      the wire SamplingParams field; any other key is refused.
    * ``status``: one of ``active``, ``disabled``, ``retired``.
    * ``tool_call_format``: how this model writes tool calls and reads tools and results
      (``bus.messages.TOOL_CALL_FORMATS``: ``"hermes"``; docs/tools.md), the parser the worker runs on its
      output; None: the model takes no ``tools`` (a request offering them answers 400).
    * ``reasoning_format``: how this model writes its thinking (``bus.messages.REASONING_FORMATS``:
      ``"think_tags"``; actors/text/reasoning.py): chat answers carry it apart as ``reasoning_content``;
      ``"none"``: never split; None: inferred from the chat template when the version loads (``models
      register`` stores what it inferred).
    * ``pricing``: USD per 1M prompt and completion tokens (:func:`check_pricing`), charged to tenants'
      budgets (gateway/budgets.py, docs/budgets.md); None: free. Read by the gateways only: a price change
      needs no process restart.
    * ``extra``: unknown keys met by from_dict, kept so that a round trip loses nothing.
    """

    name: str
    version: str
    artifact: str
    format: str = "gguf"
    quantization: str | None = None
    context_length: int | None = None
    memory_bytes: int | None = None
    tokenizer: str = "gguf"
    chat_template: str = "gguf"
    defaults: dict[str, Any] = field(default_factory=dict)
    status: str = "active"
    tool_call_format: str | None = None
    pricing: dict[str, float] | None = None
    reasoning_format: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names.validate_name("model name", self.name)
        names.validate_name("model version", self.version)
        if not isinstance(self.artifact, str) or not self.artifact:
            raise ValueError("artifact must be a non-empty path string")
        if self.format not in SUPPORTED_FORMATS:
            raise ValueError(
                f"format {self.format} is not supported yet (supported: {', '.join(SUPPORTED_FORMATS)})"
            )
        if self.quantization is not None and (not isinstance(self.quantization, str) or not self.quantization):
            raise ValueError("quantization must be a non-empty string or null")
        for fname, minimum in (("context_length", 1), ("memory_bytes", 0)):
            v = getattr(self, fname)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < minimum):
                raise ValueError(f"{fname} must be an integer >= {minimum} or null, got {v!r}")
        if self.tokenizer not in SUPPORTED_TOKENIZERS:
            raise ValueError(
                f"tokenizer {self.tokenizer} is not supported yet (supported: {', '.join(SUPPORTED_TOKENIZERS)})"
            )
        if not isinstance(self.chat_template, str) or not self.chat_template:
            raise ValueError('chat_template must be "gguf" or a non-empty template string')
        sampling_defaults(self.defaults)  # ValueError naming defaults.<key>; the stored form stays as given
        if self.status not in MANIFEST_STATUSES:
            raise ValueError(f"status must be one of {', '.join(MANIFEST_STATUSES)}, got {self.status!r}")
        if self.tool_call_format is not None and self.tool_call_format not in TOOL_CALL_FORMATS:
            raise ValueError(f"tool_call_format must be null or one of {', '.join(TOOL_CALL_FORMATS)}, "
                             f"got {self.tool_call_format!r}")
        if self.reasoning_format is not None and self.reasoning_format not in REASONING_FORMATS + (NO_REASONING,):
            raise ValueError(f"reasoning_format must be null, {NO_REASONING!r} or one of "
                             f"{', '.join(REASONING_FORMATS)}, got {self.reasoning_format!r}")
        object.__setattr__(self, "pricing", check_pricing(self.pricing))
        if not isinstance(self.extra, Mapping):
            raise ValueError("extra must be an object")
        # Private copies so that callers cannot mutate a frozen manifest through their dicts.
        object.__setattr__(self, "defaults", dict(self.defaults))
        object.__setattr__(self, "extra", dict(self.extra))

    @property
    def ref(self) -> names.ModelRef:
        """``name@version`` as a ModelRef."""
        return names.ModelRef(self.name, self.version)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (unknown keys from ``extra`` merged back at top level; ``pricing`` and
        ``reasoning_format`` only when set)."""
        d: dict[str, Any] = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name != "extra" and not (f.name in ("pricing", "reasoning_format") and getattr(self, f.name) is None):
                v = getattr(self, f.name)
                d[f.name] = dict(v) if isinstance(v, dict) else v
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelManifest":
        """Build from a dict (e.g. stored JSON). Unknown keys go to ``extra``; ValueError if invalid."""
        if not isinstance(data, Mapping):
            raise ValueError("manifest must be an object")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        missing = [k for k in ("name", "version", "artifact") if k not in data]
        if missing:
            raise ValueError(f"manifest is missing {', '.join(missing)}")
        kwargs = {k: v for k, v in data.items() if k in known}
        if kwargs.get("format") is None and isinstance(data.get("artifact"), str):
            kwargs["format"] = infer_format(data["artifact"])
        extra = {k: v for k, v in data.items() if k not in known and k != "extra"}
        return cls(**kwargs, extra=extra)
