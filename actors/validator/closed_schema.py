"""Close a client's JSON schema: objects admit only the properties they name, tuples only their prefix items (pure).

By the letter of JSON Schema an object schema that does not say ``additionalProperties`` admits any other
property, and an array with ``prefixItems`` but no ``items`` admits any further items. A grammar that follows the
letter lets a small model wander: asked for ``{"name": str, "country": str}`` the default model filled the
object with ``"description"``, ``"required"``, ``"type"`` ... until ``max_tokens`` (issue [18]). vLLM's default
backend does not allow them (xgrammar's JSON schema converter with ``strict_mode``, on by default, treats an
unstated ``additionalProperties`` / ``unevaluatedProperties`` as false and admits no items beyond
``prefixItems``), and OpenAI's strict mode requires ``additionalProperties: false`` on every object. :func:`close_schema` makes that default explicit before the schema
reaches llguidance, so its compiled grammar admits exactly what the schema names:

* an object schema (one with ``properties`` or ``patternProperties``) that says neither ``additionalProperties``
  nor ``unevaluatedProperties`` gets ``"additionalProperties": false``; one that says either keeps it (true or
  a schema). A bare ``{"type": "object"}`` names no properties at all and stays open (it is "any object");
* an array schema with ``prefixItems`` and neither ``items`` nor ``unevaluatedItems`` gets ``"items": false``;
* the members of an ``allOf`` are left open at their own level (each member's ``additionalProperties: false``
  would forbid the properties the other members name), and so is a schema that has an ``allOf`` of its own;
  their sub-schemas are closed as usual;
* the walk descends into every keyword that holds sub-schemas (``properties``, ``items``, ``anyOf``, ``$defs``
  ...), so ``$ref`` targets are closed too. The input is never modified; a new dict is returned.

``structured_outputs.disable_additional_properties: false`` (vLLM's option) asks for the letter of JSON Schema
instead: the callers then skip this function (actors/validator/structured.py).
"""

from __future__ import annotations

from typing import Any

__all__ = ["close_schema"]

# Keywords whose value is one sub-schema, a list of sub-schemas, or a name -> sub-schema map (JSON Schema 2020-12
# core and applicator vocabularies, plus draft-07's `definitions` and `additionalItems`).
_ONE = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
        "contains", "not", "if", "then", "else", "propertyNames")
_MANY = ("prefixItems", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_schema(schema: Any, *, open_level: bool = False) -> Any:
    """A copy of ``schema`` (a JSON schema: dict, or bool) closed as the module docstring says.

    ``open_level``: leave this level's object and array open (an ``allOf`` member); sub-schemas are closed
    regardless. Non-dict values (``true``, ``false``) come back unchanged. Raises nothing: a malformed schema
    is llguidance's to refuse, with its own message.
    """
    if not isinstance(schema, dict):
        return schema
    out = {k: _descend(k, v) for k, v in schema.items()}
    if "allOf" in schema and isinstance(schema["allOf"], list):
        out["allOf"] = [close_schema(s, open_level=True) for s in schema["allOf"]]
        open_level = True
    if not open_level:
        _close_level(out)
    return out


def _descend(key: str, value: Any) -> Any:
    if key in _ONE:
        return [close_schema(s) for s in value] if isinstance(value, list) else close_schema(value)
    if key in _MANY and isinstance(value, list):
        return [close_schema(s) for s in value]
    if key in _MAP and isinstance(value, dict):
        return {name: close_schema(s) for name, s in value.items()}
    return value


def _close_level(out: dict) -> None:
    """Add the closing keywords to one (already copied) schema level, where it names properties / items."""
    names_properties = isinstance(out.get("properties"), dict) or isinstance(out.get("patternProperties"), dict)
    if names_properties and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    if isinstance(out.get("prefixItems"), list) and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = False
