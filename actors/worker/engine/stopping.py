"""Stop rules of one generated token (one part of ``LLMEngine``, engine.py): EOS and ``stop_token_ids``,
stop strings, the grammar's end and the length limits decide whether a request finishes, and the text
delta it releases. Pure module (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from .request_book import RequestState


@dataclass(frozen=True)
class StopRules:
    """The engine-wide inputs of the stop rules."""

    eos_token_ids: tuple[int, ...]  # EOS / end-of-turn ids of the model (finish "stop" unless ignore_eos)
    max_model_len: int  # prompt + output cap (tokens; finish "length")

    def feed(self, r: RequestState, token: int) -> tuple[str, str | None]:
        """Record ``token`` in ``r`` (output_ids, token_ids, detokenizer, grammar) and apply the stop rules:
        (text delta released, finish reason "stop" | "length" | None). An EOS / stop id releases no text of
        its own; a stop string cuts the text before it; at the finish the held-back text is flushed."""
        r.output_ids.append(token)
        r.token_ids.append(token)
        reason = self._stop_token_reason(r, token)
        text = "" if reason else r.stop.feed(r.detok.add_tokens([token]))
        reason = reason or ("stop" if r.stop.stopped else self._grammar_reason(r, token) or self._length_reason(r))
        if reason and not r.stop.stopped:
            text += r.stop.feed(r.detok.flush())
            text += r.stop.flush()
            reason = "stop" if r.stop.stopped else reason
        return text, reason

    def _stop_token_reason(self, r: RequestState, token: int) -> str | None:
        """"stop" for EOS (unless ignore_eos) or a stop_token_id, else None."""
        p = r.req.params
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            return "stop"
        return None

    @staticmethod
    def _grammar_reason(r: RequestState, token: int) -> str | None:
        """Feed ``token`` to the request's matcher; "stop" once the grammar admits no continuation (the
        token's text is still emitted). EOS is masked out until the grammar accepts, so an EOS that reaches
        the stop rules always ends a complete output."""
        if r.grammar is None:
            return None
        r.grammar.consume(token)
        return "stop" if r.grammar.is_stopped() else None

    def _length_reason(self, r: RequestState) -> str | None:
        """"length" when max_tokens or max_model_len is reached, else None."""
        if len(r.output_ids) >= r.req.params.max_tokens or len(r.token_ids) >= self.max_model_len:
            return "length"
        return None
