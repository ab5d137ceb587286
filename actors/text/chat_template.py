"""Render a model's Jinja chat template (the `tokenizer.chat_template` string of a GGUF).

The environment follows the conventions Hugging Face chat templates are written against (the
behaviour of `transformers`' `apply_chat_template`, re-implemented here):

* `jinja2.sandbox.ImmutableSandboxedEnvironment` -- templates are untrusted data from model files;
  they cannot reach Python internals or mutate the messages passed in;
* `trim_blocks=True, lstrip_blocks=True` (a newline after a block tag is dropped, whitespace before a
  block tag on its line is stripped), plus the `loopcontrols` extension (`{% break %}`, `{% continue %}`);
* a `tojson` filter that keeps non-ASCII characters (`ensure_ascii=False`) and accepts `indent`,
  `separators` and `sort_keys`;
* globals `raise_exception(message)` (the template refuses the conversation) and
  `strftime_now(format)` (current local time);
* a `{% generation %}...{% endgeneration %}` block that simply renders its body (used by some
  templates to mark assistant spans for training).

Every failure -- a template that does not compile, a message list of the wrong shape, an exception
raised while rendering -- surfaces as :class:`ChatTemplateError`, a `ValueError`.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "render_chat", "compile_template"]


class ChatTemplateError(ValueError):
    """The chat template could not be compiled or rendered for the given messages."""


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Not HTML-escaped (jinja's built-in tojson escapes <, >, & and ' for HTML, which would
    # corrupt prompts); the output goes straight into the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """`{% generation %}body{% endgeneration %}` renders `body` unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """Compile `template` in the sandboxed chat-template environment (cached by template text).

    Raises ChatTemplateError with the line number when the template has a syntax error.
    """
    if not isinstance(template, str) or not template:
        raise ChatTemplateError("the model has no chat template")
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template syntax error at line {exc.lineno}: {exc.message}") from exc


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    **extra: Any,
) -> str:
    """Render `messages` (OpenAI-style `{"role": ..., "content": ...}` dicts) with `template`.

    `add_generation_prompt` appends the assistant header so the model answers next. `bos_token` /
    `eos_token` are exposed to the template as variables when given (a template that writes
    `{{ bos_token }}` itself needs them); `extra` becomes further template variables (`tools`,
    `documents`, ...; None values are dropped). `template_kwargs` are the request's own template options
    (`chat_template_kwargs`, e.g. Qwen3's `enable_thinking`), passed as they are (None kept: a template may
    test `is none`); they cannot override `messages`, `add_generation_prompt`, `bos_token`, `eos_token` or
    `extra` (those are set after them), as in transformers, where apply_chat_template's own arguments win.

    Returns the prompt text. Raises ChatTemplateError (a ValueError) when the template does not
    compile, `messages` is not a list of dicts each with a string `role`, or rendering fails (for
    instance the template calls `raise_exception`, or concatenates a non-string content).
    """
    if not isinstance(messages, list):
        raise ChatTemplateError("messages must be a list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object")
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{i}].role must be a string")
    compiled = compile_template(template)
    variables: dict[str, Any] = dict(template_kwargs or {})
    variables.update((k, v) for k, v in extra.items() if v is not None)
    variables["messages"] = messages
    variables["add_generation_prompt"] = bool(add_generation_prompt)
    if bos_token is not None:
        variables["bos_token"] = bos_token
    if eos_token is not None:
        variables["eos_token"] = eos_token
    try:
        return compiled.render(**variables)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template rejected the conversation: {exc}") from exc
    except (TypeError, KeyError, IndexError, AttributeError, ValueError) as exc:
        raise ChatTemplateError(f"chat template failed to render the messages: {type(exc).__name__}: {exc}") from exc
