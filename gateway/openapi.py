"""``GET /openapi.json``: the OpenAPI 3.1 document of every public HTTP endpoint (hand-written).

Response schemas mark the fields clients rely on as required (``id``, ``object``, ``created``, ``model``,
``choices``, ``index``, ``finish_reason``, ...). Request schemas follow OpenAI's reference for the fields
we implement plus our extensions; ``model`` lists the registered model references as examples so a
fuzzer reaches the generation path. Kept in one place so a schema change is one diff.
"""

from __future__ import annotations

from typing import Any

from actors.validator.validation import MAX_COMPLETION_LOGPROBS, MAX_STOP_SEQUENCES, MAX_TOP_LOGPROBS

_NUM = {"type": "number"}
_NULLABLE_STR = {"type": ["string", "null"]}
# The server accepts any budget from 1 ms; one it cannot meet ends in 503 deadline_exceeded (by design, with
# Retry-After). The documented contract starts at 1 s so that a conforming client never plans on that.
_DEADLINE = {"type": ["integer", "null"], "minimum": 1000, "maximum": 3_600_000,
             "description": "relative budget (ms); shorter budgets are accepted but may end in 503 deadline_exceeded"}


def _error_response(desc: str) -> dict:
    return {"description": desc, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _errors(*statuses: int) -> dict:
    names = {400: "invalid request (param names the field)", 401: "missing or unknown API key",
             404: "unknown model", 409: "idempotency key reused with a different body", 408: "request cancelled",
             413: "body over the size limit", 429: "quota or tenant queue full", 502: "response stream broken",
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
        "ignore_eos": {"type": ["boolean", "null"]},
        "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}},
    }


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
        "tools": {"type": ["array", "null"]}, "tool_choice": {}, "response_format": {}, "logit_bias": {},
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
        "best_of": {"type": ["integer", "null"]}, "suffix": _NULLABLE_STR, "logit_bias": {},
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
    finish = {"type": ["string", "null"], "enum": ["stop", "length", None]}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                            "total_tokens": {"type": "integer"},
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
                                   "refusal": _NULLABLE_STR}}}}}}},
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
                                                                          "content": _NULLABLE_STR}}}}}}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": {
                "type": "object", "required": ["id", "object", "created", "owned_by"],
                "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                               "owned_by": {"type": "string"}}}}}},
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
                                              "text/event-stream": {"schema": {"type": "string"}}}},
                          **_errors(400, 401, 404, 408, 409, 413, 429, 502, 503)},
            "security": [{"bearerAuth": []}]}


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
            "/v1/models": {"get": {"summary": "Registered models", "security": [{"bearerAuth": []}],
                                   "responses": {"200": {"description": "models", "content": {"application/json": {
                                       "schema": {"$ref": "#/components/schemas/ModelList"}}}}, **_errors(401)}}},
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
