"""``GET /openapi.json``: the OpenAPI 3.1 document of every public HTTP endpoint (hand-written).

Response schemas mark the fields clients rely on as required (``id``, ``object``, ``created``, ``model``,
``choices``, ``index``, ``finish_reason``, ...). Request schemas follow OpenAI's reference for the fields
we implement plus our extensions; ``model`` lists the registered model references as examples so a
fuzzer reaches the generation path. Kept in one place so a schema change is one diff.
"""

from __future__ import annotations

from typing import Any

from control.policy.limits import (MAX_COMPLETION_LOGPROBS, MAX_STOP_SEQUENCES, MAX_TOP_LOGPROBS,
                                   RESERVED_TEMPLATE_VARIABLES)

_NUM = {"type": "number"}
_NULLABLE_STR = {"type": ["string", "null"]}
# The server accepts any budget from 1 ms; one it cannot meet ends in 503 deadline_exceeded (by design, with
# Retry-After). The documented contract starts at 1 s so that a conforming client never plans on that.
_DEADLINE = {"type": ["integer", "null"], "minimum": 1000, "maximum": 3_600_000,
             "description": "relative budget (ms); shorter budgets are accepted but may end in 503 deadline_exceeded"}



#: one server-sent event as parsed from ``text/event-stream`` (WHATWG HTML, "Server-sent events"): its ``data``
#: (JSON text, or ``[DONE]``) and, for the Responses API, its ``event`` name. Schemathesis (ST108) checks each
#: event of a streamed answer against this.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"},
    "retry": {"type": "integer"}}}

def _error_response(desc: str) -> dict:
    return {"description": desc, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _errors(*statuses: int) -> dict:
    names = {400: "invalid request (param names the field)", 401: "missing or unknown API key",
             404: "unknown model", 409: "idempotency key reused with a different body", 408: "request cancelled",
             413: "body over the size limit", 429: "quota, tenant queue full, or budget_exhausted",
             502: "response stream broken",
             503: "overload, no capacity, or deadline"}
    return {str(s): _error_response(names[s]) for s in statuses}


def _sampling_props() -> dict[str, Any]:
    stop = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                           "maxItems": MAX_STOP_SEQUENCES}, {"type": "null"}]}
    return {
        "max_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": ["integer", "null"], "minimum": -1},
        "n": {"type": ["integer", "null"], "minimum": 1, "description": "server-capped (default cap 8)"},
        "seed": {"type": ["integer", "null"]},
        "stop": stop,
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"], "additionalProperties": False,
                           "properties": {"include_usage": {"type": ["boolean", "null"]}}},
        "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
        "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
        "user": _NULLABLE_STR,
        "priority": {"type": ["string", "null"], "enum": ["interactive", "batch", None]},
        "deadline_ms": _DEADLINE,
        "ignore_eos": {"type": ["boolean", "null"], "description": "not with a structured output format"},
        "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}},
        "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1, "description": "0 = off"},
        "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 10,
                               "description": "CTRL's; 1 = off"},
        "logit_bias": {"type": ["object", "null"], "maxProperties": 300, "propertyNames": {"pattern": "^[0-9]+$"},
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                       "description": "token id (in the vocabulary) -> bias added to its logit"},
        "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"},
                     "description": "advisory (docs/api.md)"},
        "service_tier": {"type": ["string", "null"], "description": "advisory (docs/api.md)"},
        "store": {"enum": [False, None], "description": "nothing is stored: true is refused"},
        **_structured_props(),
    }


def _structured_props() -> dict[str, Any]:
    """Structured-output fields (actors/validator/structured.py): at most one format per request."""
    schema = {"type": "object"}
    json_schema = {"type": "object", "required": ["name", "schema"], "additionalProperties": False, "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 64}, "description": {"type": "string"},
        "schema": schema, "strict": {"type": ["boolean", "null"]}}}
    response_format = {"oneOf": [
        {"type": "null"},
        {"type": "object", "required": ["type"], "additionalProperties": False,
         "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
         "properties": {"type": {"const": "json_schema"}, "json_schema": json_schema}}]}
    text = {"type": ["string", "null"], "minLength": 1}
    choice = {"type": ["array", "null"], "items": {"type": "string"}, "minItems": 1, "maxItems": 1024}
    json_value = {"oneOf": [schema, {"type": "string"}, {"type": "null"}], "description": "JSON schema or its text"}
    flag = {"type": ["boolean", "null"]}
    so = {"type": ["object", "null"], "additionalProperties": False, "properties": {
        "json": json_value, "regex": text, "choice": choice, "grammar": text, "json_object": flag,
        "disable_any_whitespace": flag, "whitespace_pattern": text, "disable_fallback": flag,
        "disable_additional_properties": flag}}
    return {"response_format": response_format, "structured_outputs": so, "guided_json": json_value,
            "guided_regex": text, "guided_choice": choice,
            "guided_grammar": {**text, "description": "Lark, or GBNF / EBNF"},
            "guided_whitespace_pattern": text,
            "guided_decoding_backend": {"type": ["string", "null"], "description": "advisory: llguidance is used"}}


def _chat_request(models: list[str]) -> dict:
    content_part = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role"],
               "properties": {"role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                              "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": content_part},
                                                    {"type": "null"}]},
                              "name": {"type": "string"}, "tool_calls": {"type": "array"},
                              "tool_call_id": {"type": "string"}}}
    return {"type": "object", "required": ["model", "messages"], "additionalProperties": False, "properties": {
        "model": {"type": "string", "enum": models},
        "messages": {"type": "array", "items": message, "minItems": 1},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        "logprobs": {"type": ["boolean", "null"]},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
        "tools": {"type": ["array", "null"]}, "tool_choice": {}, "parallel_tool_calls": {"type": ["boolean", "null"]},
        "chat_template_kwargs": {"type": ["object", "null"], "propertyNames": {"minLength": 1, "not": {"enum": sorted(
            RESERVED_TEMPLATE_VARIABLES)}}, "description": "extra chat-template variables (vLLM's), e.g. "
            "{\"enable_thinking\": false}; a variable the template does not use changes nothing"},
        "functions": {"type": "null", "description": "deprecated (use tools): any value is refused"},
        "function_call": {"type": "null", "description": "deprecated (use tool_choice): any value is refused"},
        "modalities": {"oneOf": [{"type": "null"}, {"const": ["text"]}], "description": "text output only"},
        "audio": {"type": "null", "description": "no audio output: any value is refused"},
        "prediction": {"type": "null", "description": "no predicted outputs: any value is refused"},
        "web_search_options": {"type": "null", "description": "no web search: any value is refused"},
        **{k: {"type": ["string", "null"], "description": "advisory (docs/api.md)"}
           for k in ("safety_identifier", "prompt_cache_key", "reasoning_effort", "verbosity")},
        **_sampling_props()}}


def _completion_request(models: list[str]) -> dict:
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    prompt = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}, ids,
                        {"type": "array", "items": ids, "minItems": 1}]}
    return {"type": "object", "required": ["model", "prompt"], "additionalProperties": False, "properties": {
        "model": {"type": "string", "enum": models},
        "prompt": prompt,
        "echo": {"type": ["boolean", "null"]},
        "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS},
        "best_of": {"enum": [1, None], "description": "only 1"},
        "suffix": {"type": ["string", "null"], "maxLength": 0, "description": "no insertion: a suffix is refused"},
        **_sampling_props()}}


def _components() -> dict:
    top_lp = {"type": "object", "required": ["token", "logprob", "bytes"],
              "properties": {"token": {"type": "string"}, "logprob": _NUM,
                             "bytes": {"type": ["array", "null"], "items": {"type": "integer"}}}}
    chat_lp = {"type": ["object", "null"], "required": ["content"], "properties": {
        "content": {"type": ["array", "null"], "items": {
            "type": "object", "required": ["token", "logprob", "bytes", "top_logprobs"],
            "properties": {**top_lp["properties"], "top_logprobs": {"type": "array", "items": top_lp}}}}}}
    cmpl_lp = {"type": ["object", "null"], "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
               "properties": {"tokens": {"type": "array", "items": {"type": "string"}},
                              "token_logprobs": {"type": "array", "items": _NUM},
                              "top_logprobs": {"type": "array", "items": {"type": "object"}},
                              "text_offset": {"type": "array", "items": {"type": "integer"}}}}
    finish = {"type": ["string", "null"], "enum": ["stop", "length", "tool_calls", None]}
    tool_calls = {"type": "array", "items": {"type": "object", "required": ["function"],
                                             "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                                                            "function": {"type": "object"}}}}  # docs/tools.md
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                            "total_tokens": {"type": "integer"},
                            "prompt_tokens_details": {"type": "object", "properties": {
                                "cached_tokens": {"type": "integer", "minimum": 0}}},
                            "completion_tokens_details": {"type": "object", "properties": {  # reasoning models
                                "reasoning_tokens": {"type": "integer", "minimum": 0}}},
                            "actorserve_timing": {"type": "object", "additionalProperties": _NUM}}}
    head = {"id": {"type": "string"}, "created": {"type": "integer"}, "model": {"type": "string"},
            "system_fingerprint": _NULLABLE_STR}
    req = ["id", "object", "created", "model", "choices"]
    return {"securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}}, "schemas": {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": _NULLABLE_STR,
                           "code": _NULLABLE_STR}}}},
        "Usage": usage,
        "ChatCompletion": {"type": "object", "required": req + ["usage"], "properties": {
            **head, "object": {"const": "chat.completion"}, "usage": {"$ref": "#/components/schemas/Usage"},
            "choices": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["index", "message", "finish_reason", "logprobs"],
                "properties": {"index": {"type": "integer", "minimum": 0}, "finish_reason": finish,
                               "logprobs": chat_lp,
                               "message": {"type": "object", "required": ["role", "content"], "properties": {
                                   "role": {"const": "assistant"}, "content": _NULLABLE_STR,
                                   "refusal": _NULLABLE_STR, "tool_calls": tool_calls,
                                   "reasoning_content": {**_NULLABLE_STR, "description": "a reasoning model's "
                                                         "thinking (docs/api.md)"}}}}}}}},
        "Completion": {"type": "object", "required": req + ["usage"], "properties": {
            **head, "object": {"const": "text_completion"}, "usage": {"$ref": "#/components/schemas/Usage"},
            "choices": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["index", "text", "finish_reason", "logprobs"],
                "properties": {"index": {"type": "integer", "minimum": 0}, "text": {"type": "string"},
                               "finish_reason": finish, "logprobs": cmpl_lp}}}}},
        "ChatCompletionChunk": {"type": "object", "required": req, "properties": {
            **head, "object": {"const": "chat.completion.chunk"},
            "usage": {"oneOf": [{"$ref": "#/components/schemas/Usage"}, {"type": "null"}]},
            "actorserve_timing": {"type": "object"},
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "delta", "finish_reason"],
                "properties": {"index": {"type": "integer"}, "finish_reason": finish, "logprobs": chat_lp,
                               "delta": {"type": "object", "properties": {"role": {"const": "assistant"},
                                                                          "content": _NULLABLE_STR,
                                                                          "reasoning_content": _NULLABLE_STR,
                                                                          "tool_calls": tool_calls}}}}}}},
        "Model": {"type": "object", "required": ["id", "object", "created", "owned_by"],
                  "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                                 "owned_by": {"type": "string"}}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}}}},
    }}


def _generate_op(summary: str, request: dict, response_ref: str) -> dict:
    return {"summary": summary,
            "parameters": [{"name": "X-Request-Id", "in": "header", "required": False,
                            "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.:-]{1,128}$"}},
                           {"name": "x-actorserve-deadline-ms", "in": "header", "required": False,
                            "schema": _DEADLINE}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {"200": {"description": "the completion (JSON), or an SSE stream when stream is true",
                                  "headers": {"X-Request-Id": {"schema": {"type": "string"}}},
                                  "content": {"application/json": {"schema": {"$ref": response_ref}},
                                              "text/event-stream": {"schema": SSE_EVENT}}},
                          **_errors(400, 401, 404, 408, 409, 413, 429, 502, 503)},
            "security": [{"bearerAuth": []}]}


def _responses_paths(models: list[str]) -> dict:
    """The Responses API paths (gateway/responses_api.py, docs/responses.md): request fields are those of
    gateway/responses_format.py (translated, advisory, default-only), schemas inline."""
    s, null_s = {"type": "string"}, {"type": ["string", "null"]}
    parts = {"oneOf": [s, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"], "properties": {
            "type": {"enum": ["input_text", "output_text", "text"]}, "text": s}}}]}
    item = {"oneOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
            "content": parts, "id": s}},
        {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
            "type": {"const": "function_call"}, "call_id": s, "name": s, "arguments": s, "id": s}},
        {"type": "object", "required": ["type", "call_id", "output"], "properties": {
            "type": {"const": "function_call_output"}, "call_id": s, "output": parts, "id": s}},
        {"type": "object", "required": ["type"], "properties": {  # a previous thinking: kept, not prompted
            "type": {"const": "reasoning"}, "id": s, "content": {"type": "array", "items": {
                "type": "object", "required": ["text"], "properties": {"type": {"const": "reasoning_text"},
                                                                      "text": s}}}}}]}
    tool = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function"}, "name": {"type": "string", "minLength": 1}, "description": null_s,
        "parameters": {"type": ["object", "null"]}, "strict": {"type": ["boolean", "null"]}}}
    fmt = {"oneOf": [{"type": "object", "required": ["type"],
                      "properties": {"type": {"enum": ["text", "json_object"]}}},
                     {"type": "object", "required": ["type", "name", "schema"], "properties": {
                         "type": {"const": "json_schema"}, "name": {"type": "string", "minLength": 1, "maxLength": 64},
                         "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]},
                         "description": s}}]}
    flag = {"type": ["boolean", "null"]}
    request = {"type": "object", "required": ["model", "input"], "additionalProperties": False, "properties": {
        "model": {"type": "string", "enum": models}, "input": {"oneOf": [s, {"type": "array", "items": item,
                                                                              "minItems": 1}]},
        "instructions": null_s, "previous_response_id": null_s,
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "tools": {"type": ["array", "null"], "items": tool},
        "tool_choice": {"oneOf": [{"enum": ["auto", "none", "required", None]},
                                  {"type": "object", "required": ["type", "name"],
                                   "properties": {"type": {"const": "function"}, "name": s}}]},
        "text": {"type": ["object", "null"], "properties": {"format": fmt}},
        "stream": flag, "store": flag, "background": {**flag, "description": "needs store; not with stream"},
        "parallel_tool_calls": flag,
        "metadata": {"type": ["object", "null"], "maxProperties": 16,
                     "additionalProperties": {"type": "string", "maxLength": 512}},
        "priority": {"enum": ["interactive", "batch", None]}, "deadline_ms": _DEADLINE,
        "seed": {"type": ["integer", "null"]},
        **{k: {**null_s, "description": "advisory (docs/responses.md)"}
           for k in ("service_tier", "prompt_cache_key", "safety_identifier", "user")},
        "stream_options": {"type": ["object", "null"], "description": "advisory"},
        "reasoning": {"type": ["object", "null"], "maxProperties": 0, "description": "not served (a model that reasons returns a reasoning output item)"},
        "include": {"type": ["array", "null"], "maxItems": 0}, "truncation": {"enum": ["disabled", None]},
        "max_tool_calls": {"type": "null"}, "top_logprobs": {"enum": [0, None]}}}
    response = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
                "properties": {"id": {"type": "string", "pattern": "^resp_"}, "object": {"const": "response"},
                               "created_at": {"type": "integer"}, "model": s,
                               "status": {"enum": ["queued", "in_progress", "completed", "incomplete", "failed",
                                                   "cancelled"]},
                               "output": {"type": "array", "items": {"type": "object", "required": ["type", "id"]}},
                               "usage": {"type": ["object", "null"]}, "error": {"type": ["object", "null"]}}}
    ok = {"200": {"description": "the response", "content": {"application/json": {"schema": response}}}}
    rid = [{"name": "id", "in": "path", "required": True, "schema": s}]
    sec = [{"bearerAuth": []}]
    create = {"summary": "Create a model response (OpenAI Responses API)", "security": sec,
              "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False, "schema": s},
                             {"name": "x-actorserve-deadline-ms", "in": "header", "required": False,
                              "schema": _DEADLINE}],
              "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
              "responses": {"200": {"description": "the response (JSON), or its SSE events when stream is true",
                                    "content": {"application/json": {"schema": response},
                                                "text/event-stream": {"schema": SSE_EVENT}}},
                            **_errors(400, 401, 404, 408, 409, 413, 429, 502, 503)}}
    items = {"type": "object", "required": ["object", "data", "has_more"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}},
        "first_id": null_s, "last_id": null_s, "has_more": {"type": "boolean"}}}
    deleted = {"type": "object", "required": ["id", "object", "deleted"], "properties": {
        "id": s, "object": {"const": "response"}, "deleted": {"const": True}}}
    page = [{"name": "limit", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1,
                                                                            "maximum": 100}},
            {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}},
            {"name": "after", "in": "query", "required": False, "schema": s}]
    return {
        "/v1/responses": {"post": create},
        "/v1/responses/{id}": {
            "get": {"summary": "A stored response", "security": sec, "parameters": rid,
                    "responses": {**ok, **_errors(401, 404, 503)}},
            "delete": {"summary": "Delete a stored response", "security": sec, "parameters": rid,
                       "responses": {"200": {"description": "deleted", "content": {"application/json": {
                           "schema": deleted}}}, **_errors(401, 404, 503)}}},
        "/v1/responses/{id}/input_items": {"get": {
            "summary": "A stored response's input items", "security": sec, "parameters": rid + page,
            "responses": {"200": {"description": "a page of items", "content": {"application/json": {
                "schema": items}}}, **_errors(400, 401, 404, 503)}}},
        "/v1/responses/{id}/cancel": {"post": {
            "summary": "Cancel a background response", "security": sec, "parameters": rid,
            "responses": {**ok, **_errors(400, 401, 404, 503)}}},
    }


def _usage_report() -> dict:
    """``GET /v1/usage`` (gateway/tenancy.py): rows per model version (tokens, cost in USD) and the budget
    of the current period (gateway.budgets.view; null without a budget)."""
    num, count = {"type": "number", "minimum": 0}, {"type": "integer", "minimum": 0}
    row = {"type": "object", "required": ["model", "requests", "prompt_tokens", "completion_tokens", "total_tokens",
                                          "by_status", "cost_usd"],
           "properties": {"model": {"type": "string"}, "requests": count, "prompt_tokens": count,
                          "completion_tokens": count, "total_tokens": count, "by_status": {"type": "object"},
                          "cost_usd": num}}
    budget = {"type": "object", "required": ["budget_usd", "period", "spent_usd", "reserved_usd", "remaining_usd"],
              "properties": {"budget_usd": num, "period": {"enum": ["day", "month", "total"]},
                             "period_id": {"type": "string"}, "resets_at": {"type": ["number", "null"]},
                             "spent_usd": num, "reserved_usd": num, "remaining_usd": num, "unbilled_usd": num,
                             "in_flight": count, "by_model_usd": {"type": "object",
                                                                  "additionalProperties": num}}}
    return {"type": "object", "required": ["object", "tenant", "data", "cost"], "properties": {
        "object": {"const": "usage"}, "tenant": {"type": "string"}, "data": {"type": "array", "items": row},
        "cost": {"type": "object", "required": ["total_usd", "budget"], "properties": {
            "total_usd": num, "budget": {"oneOf": [budget, {"type": "null"}]}}}}}


def openapi_document(models: list[str], server_url: str | None = None) -> dict:
    """The OpenAPI 3.1 document; ``models`` become the examples of the ``model`` field."""
    models = models or ["smollm2-135m-instruct"]
    status = {"type": "object"}
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "actorserve", "version": "1",
                 "description": "OpenAI-compatible inference API (see docs/api.md)."},
        "paths": {
            "/v1/chat/completions": {"post": _generate_op("Chat completion", _chat_request(models),
                                                          "#/components/schemas/ChatCompletion")},
            "/v1/completions": {"post": _generate_op("Text completion", _completion_request(models),
                                                     "#/components/schemas/Completion")},
            **_responses_paths(models),
            "/v1/models": {"get": {"summary": "Registered models", "security": [{"bearerAuth": []}],
                                   "responses": {"200": {"description": "models", "content": {"application/json": {
                                       "schema": {"$ref": "#/components/schemas/ModelList"}}}}, **_errors(401)}}},
            "/v1/models/{model}": {"get": {
                "summary": "One registered model (name, name@version or an adapter)", "security": [{"bearerAuth": []}],
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the model", "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Model"}}}}, **_errors(401, 404)}}},
            "/v1/usage": {"get": {"summary": "The caller's usage, cost and budget (docs/budgets.md)",
                                  "security": [{"bearerAuth": []}], "responses": {"200": {
                                      "description": "usage report", "content": {"application/json": {
                                          "schema": _usage_report()}}}, **_errors(401)}}},
            "/healthz": {"get": {"summary": "Liveness", "responses": {"200": {
                "description": "alive", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}}}}}}}},
            "/readyz": {"get": {"summary": "Readiness", "responses": {
                "200": {"description": "ready", "content": {"application/json": {"schema": status}}},
                "503": {"description": "not ready", "content": {"application/json": {"schema": status}}}}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {
                "description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        },
        "components": _components(),
    }
    if server_url:
        doc["servers"] = [{"url": server_url}]
    return doc
