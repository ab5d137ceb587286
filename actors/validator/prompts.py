"""Prompt preparation: render the chat template, tokenize, check lengths, settle ``max_tokens`` (pure).

:func:`prepare_prompt` implements vLLM's length policy (reject what cannot fit, clamp what the server
caps); :func:`default_stop_token_ids` finds the tokens that end generation by default (EOS, end of turn).
"""

from __future__ import annotations

from typing import Protocol

from actors.text.chat_template import ChatTemplateError, render_chat
from actors.text.tool_calls import render_messages

from .errors import RequestError
from .fields import ValidatedRequest, bad



class Tokenizer(Protocol):
    """What validation needs of a tokenizer (actors.text.tokenizer.GGUFTokenizer has it)."""

    bos_token: str | None
    eos_token: str | None
    eos_token_id: int | None
    vocab_size: int
    chat_template: str | None
    special_tokens: dict[str, int]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def encode_chat(self, text: str) -> list[int]: ...


def prepare_prompt(
    validated: ValidatedRequest,
    tokenizer: Tokenizer,
    chat_template: str | None,
    max_model_len: int,
    default_max_tokens: int | None,
    max_tokens_cap: int | None,
    tool_format: str | None = None,
) -> tuple[list[int], int]:
    """Render and tokenize the prompt; return `(prompt_token_ids, max_tokens)` (both in tokens).

    Chat: `chat_template` (or the tokenizer's own when None) is rendered with
    `add_generation_prompt=True` and the text tokenized without adding BOS/EOS (the template writes
    whatever markers it wants; tools and tool messages in ``tool_format``: :func:`render_prompt`).
    Completions: a string prompt is tokenized with the tokenizer's own
    BOS policy; a token-id prompt is used as given (ids must lie in the vocabulary).

    Length policy (vLLM's, `OpenAIServing._validate_input` + `get_max_tokens`):

    * prompt length >= `max_model_len` -> RequestError 400, code `context_length_exceeded`, param
      "messages"/"prompt";
    * client `max_tokens` given and prompt + max_tokens > `max_model_len` -> the same 400 with param
      "max_tokens" (or "max_completion_tokens"): rejected, not clamped, like vLLM and OpenAI;
    * otherwise `max_tokens` = min(client value or `default_max_tokens`, `max_tokens_cap`,
      `max_model_len` - prompt length), None meaning "no limit from this source". The operator cap
      clamps silently (the answer then ends with finish_reason "length"), as vLLM does with a
      generation-config `max_new_tokens`.

    Raises RequestError(400) also for an empty prompt, out-of-vocabulary token ids (in the prompt, or
    as `logit_bias` keys: param "logit_bias"), or a chat template that refuses the conversation.
    """
    if max_model_len < 2:
        raise ValueError("max_model_len must be >= 2")
    oov_bias = next((t for t, _ in validated.logit_bias if t >= tokenizer.vocab_size), None)
    if oov_bias is not None:
        raise bad(f"token id {oov_bias} in 'logit_bias' is outside the vocabulary (0..{tokenizer.vocab_size - 1})",
                  "logit_bias")
    ids = _prompt_ids(validated, tokenizer, chat_template, tool_format)
    return ids, _max_tokens(validated, len(ids), max_model_len, default_max_tokens, max_tokens_cap)


def _prompt_ids(validated: ValidatedRequest, tokenizer: Tokenizer, chat_template: str | None,
                tool_format: str | None = None) -> list[int]:
    """The prompt's token ids (chat: the rendered template). RequestError 400 naming the prompt field."""
    if validated.kind == "chat":
        # BOS as the artifact's reference does it: a GGUF as llama.cpp (added unless the template wrote it), an HF
        # directory as transformers (never added); actors/text tokenizers' encode_chat
        ids = tokenizer.encode_chat(render_prompt(validated, tokenizer, chat_template, tool_format))
    elif isinstance(validated.prompt, tuple):
        ids = list(validated.prompt)
        vs = tokenizer.vocab_size
        oov = next((t for t in ids if not 0 <= t < vs), None)
        if oov is not None:
            raise bad(f"token id {oov} in 'prompt' is outside the vocabulary (0..{vs - 1})", "prompt")
    else:
        ids = tokenizer.encode(validated.prompt or "", add_special_tokens=True)
    if not ids:
        raise bad(f"'{validated.prompt_param}' must not be empty", validated.prompt_param)
    return ids


def render_prompt(validated: ValidatedRequest, tokenizer: Tokenizer, chat_template: str | None,
                  tool_format: str | None = None) -> str:
    """The prompt text of a chat request: ``chat_template`` (or the tokenizer's) rendered with the assistant
    header appended.

    With a ``tool_format`` (the manifest's ``tool_call_format``), the messages are first rewritten by
    actors.text.tool_calls.render_messages: the offered tools (when ``tool_choice`` is not "none") go into
    the system turn, assistant ``tool_calls`` and ``tool`` results become text in that format (model chat
    templates such as SmolLM2's render only ``content``). Without one, messages go to the template as
    they are. The request's ``chat_template_kwargs`` become further template variables (Qwen3's
    ``enable_thinking``, ...). RequestError 400 (param "messages") when the template refuses the conversation.
    """
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if not template:
        raise bad("this model has no chat template; use the completions endpoint", "messages")
    messages = [dict(m) for m in validated.messages or ()]
    if tool_format is not None:
        tools = validated.tools
        messages = render_messages(tool_format, messages, tools.tools if tools is not None and tools.active else None)
    try:
        return render_chat(template, messages, add_generation_prompt=True, bos_token=tokenizer.bos_token,
                           eos_token=tokenizer.eos_token, template_kwargs=validated.chat_template_kwargs)
    except ChatTemplateError as exc:
        raise bad(str(exc), "messages") from exc


def _too_long(message: str, param: str) -> RequestError:
    return RequestError(400, message, param=param, code="context_length_exceeded")


def _max_tokens(validated: ValidatedRequest, n: int, max_model_len: int, default_max_tokens: int | None,
                max_tokens_cap: int | None) -> int:
    """Settle ``max_tokens`` for a prompt of ``n`` tokens (the policy of :func:`prepare_prompt`)."""
    param = validated.prompt_param
    what = "messages" if param == "messages" else "prompt"
    limit = f"This model's maximum context length is {max_model_len} tokens. However, "
    if n >= max_model_len:
        raise _too_long(f"{limit}your {what} resulted in {n} tokens. Please reduce the length of the {what}.",
                        param)
    wanted = default_max_tokens
    if validated.max_tokens is not None:
        if n + validated.max_tokens > max_model_len:
            raise _too_long(f"{limit}you requested {n + validated.max_tokens} tokens ({n} in the {what}, "
                            f"{validated.max_tokens} in the completion). Please reduce the length of the {what} "
                            f"or completion.", validated.max_tokens_param)
        wanted = validated.max_tokens
    limits = [max_model_len - n] + [v for v in (wanted, max_tokens_cap) if v is not None]
    return max(1, min(limits))


def default_stop_token_ids(tokenizer: Tokenizer, chat_template: str | None = None) -> tuple[int, ...]:
    """Token ids that end generation by default: EOS, then the chat template's end-of-turn marker.

    The end-of-turn marker is found by rendering a one-turn conversation whose assistant reply is a
    sentinel and tokenizing what the template writes right after it: if that starts with a special
    (control) token, that token is the marker ("<|im_end|>" for ChatML). Control tokens whose text
    is a well-known end-of-generation marker (the list llama.cpp also treats as end of generation:
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", ...) are added too, then the
    tokenizer's own end-of-generation ids (``eog_token_ids``: GGUF eos/eot/eom and llama.cpp's by-name set,
    or an HF directory's generation_config.json ``eos_token_id`` list; actors/text/eog.py), in id order.
    Returns the ids in that order, without duplicates.
    """
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    specials = dict(tokenizer.special_tokens)
    template = chat_template if chat_template is not None else tokenizer.chat_template
    end_of_turn = _end_of_turn(tokenizer, template, set(specials.values())) if template else None
    if end_of_turn is not None:
        ids.append(end_of_turn)
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                 "<|end_of_text|>", "</s>", "<|return|>", "<|call|>"):
        if name in specials:
            ids.append(specials[name])
    ids.extend(sorted(getattr(tokenizer, "eog_token_ids", ())))
    seen: set[int] = set()
    return tuple(i for i in ids if not (i in seen or seen.add(i)))


def _end_of_turn(tokenizer: Tokenizer, template: str, special_ids: set[int]) -> int | None:
    """The special token ``template`` writes right after an assistant reply, if any (see above)."""
    sentinel = "Zq7SentinelReply"
    try:
        text = render_chat(template, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": sentinel}],
                           add_generation_prompt=False, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    except ChatTemplateError:
        return None
    pos = text.rfind(sentinel)
    after = tokenizer.encode(text[pos + len(sentinel):], add_special_tokens=False) if pos >= 0 else []
    return after[0] if after and after[0] in special_ids else None
