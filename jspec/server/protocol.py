"""The OpenAI wire format: request schemas, response bodies and error objects.

Requests are validated strictly (pydantic strict mode, unknown fields refused): a field of the
wrong type (``"max_tokens": "ten"``, ``"temperature": true``) is a 400, not a silent coercion.
Fields of the OpenAI API that jspec does not implement are accepted only at their "off" value
(``n`` = 1, no ``logprobs``, no penalties, no tools, ...), and refused with a message that names
them otherwise. jspec extensions, sent with the ``openai`` client's ``extra_body``:
``top_k``, ``ignore_eos`` and ``num_speculative_tokens`` (this request's cap on drafts).

Structured output, on both endpoints: OpenAI's ``response_format`` (``json_object``, or
``json_schema`` with its ``schema``), vLLM's ``structured_outputs`` object (``json``, ``regex``,
``choice``, ``grammar``) and vLLM's earlier ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``; one of them per request. A schema, regex or grammar
that does not compile is a 400 before the request is queued.

Defaults follow OpenAI, not jspec's library: ``temperature`` 1.0, completions ``max_tokens`` 16,
chat ``max_tokens`` up to the context (``max_model_len`` minus the prompt).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

from jspec.config import SamplingParams, StructuredOutputsParams
from jspec.errors import ConfigError, JspecError

MAX_PROMPTS = 64  # prompts in one batched completions request
MAX_STOP = 16
MAX_BODY_BYTES = 16 * 2**20


class APIError(Exception):
    """An error the client caused or must see: rendered as an OpenAI error object."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_message(errors: list[dict]) -> tuple[str, Optional[str]]:
    """(message, param) of a pydantic / FastAPI validation error list (the first error)."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if not loc and e.get("type") in ("model_type", "model_attributes_type", "dict_type"):
        return "the request body must be a JSON object", None
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})", None
    # drop the type names a union adds to the location ("prompt.str", "stop.list[str]")
    path = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool")]
    param = ".".join(path) or None
    msg = e.get("msg", "invalid value")
    if e.get("type") == "extra_forbidden":
        msg = "unknown field (not part of the API, or not supported by jspec)"
    elif e.get("type") == "missing":
        msg = "required field is missing"
    return (f"{param}: {msg}" if param else msg), param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None  # vLLM's; accepted, usage is sent at the end


class _Sampling(_Strict):
    """Fields common to both endpoints."""

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None  # accepted and ignored (OpenAI's abuse-monitoring id)
    # jspec / vLLM extensions
    top_k: Optional[int] = None
    ignore_eos: Optional[bool] = None
    num_speculative_tokens: Optional[int] = None
    # structured output (see the module docstring)
    response_format: Optional[dict] = None
    structured_outputs: Optional[dict] = None
    guided_json: Optional[Union[dict, str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    def _constraint(self) -> Optional[StructuredOutputsParams]:
        """The request's structured-output constraint, from whichever field names it."""
        given = {}
        rf = self.response_format
        if rf is not None and rf != {"type": "text"}:
            kind = rf.get("type")
            if kind == "json_object":
                given["response_format"] = {"json_object": True}
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                    raise APIError("response_format: json_schema needs {\"name\": ..., \"schema\": {...}}",
                                   param="response_format")
                given["response_format"] = {"json": js["schema"]}
            else:
                raise APIError(f"response_format: type must be text, json_object or json_schema, got {kind!r}",
                               param="response_format")
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given[name] = {key: getattr(self, name)}
        if not given:
            return None
        if len(given) > 1:
            raise APIError(f"{', '.join(given)}: give one structured-output constraint, not several",
                           param=next(iter(given)))
        (param, fields), = given.items()
        try:
            return StructuredOutputsParams.from_dict(fields)
        except ConfigError as e:
            raise APIError(str(e), param=param) from None

    def _refuse_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise APIError(f"n: only n = 1 is supported (one completion per prompt), got {self.n}", param="n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(f"{name}: not supported by jspec (only 0)", param=name)
        if self.logit_bias:
            raise APIError("logit_bias: not supported by jspec", param="logit_bias")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stop) > MAX_STOP:
            raise APIError(f"stop: at most {MAX_STOP} stop strings, got {len(stop)}", param="stop")

    def sampling_params(self, default_max_tokens: Optional[int]) -> tuple[SamplingParams, bool]:
        """(params, fill): ``fill`` means max_tokens was not given and has no default; the
        engine thread sets it to what the context leaves after the prompt."""
        self._refuse_unsupported()
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise APIError(f"max_tokens: must be >= 1, got {max_tokens}", param="max_tokens")
        kw: dict[str, Any] = dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed, max_tokens=max_tokens or 1, ignore_eos=bool(self.ignore_eos),
            stop=() if self.stop is None else self.stop, num_speculative_tokens=self.num_speculative_tokens,
            structured_outputs=self._constraint())
        try:
            return SamplingParams(**kw), max_tokens is None
        except ConfigError as e:
            param = str(e).split(" ", 1)[0]
            raise APIError(str(e), param=param if param in kw else None) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a batch of
    either (one choice per prompt, ``index`` in order)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: Optional[bool] = None
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str):
            out = [p]
        elif not p:
            raise APIError("prompt: is empty", param="prompt")
        elif isinstance(p[0], int):
            out = [list(p)]
        else:
            out = list(p)
        if len(out) > MAX_PROMPTS:
            raise APIError(f"prompt: at most {MAX_PROMPTS} prompts in one request, got {len(out)}", param="prompt")
        for x in out:
            if not x:
                raise APIError("prompt: is empty", param="prompt")
        return out

    def check(self) -> None:
        if self.echo:
            raise APIError("echo: not supported by jspec", param="echo")
        if self.logprobs is not None:
            raise APIError("logprobs: not supported by jspec", param="logprobs")
        if self.best_of not in (None, 1):
            raise APIError("best_of: only 1 is supported", param="best_of")
        if self.suffix:
            raise APIError("suffix: not supported by jspec", param="suffix")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: the messages go through the model's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None  # OpenAI's newer name for max_tokens
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None

    def check(self) -> None:
        if not self.messages:
            raise APIError("messages: at least one message is required", param="messages")
        if self.logprobs or self.top_logprobs:
            raise APIError("logprobs: not supported by jspec", param="logprobs")
        if self.tools or self.tool_choice not in (None, "none"):
            raise APIError("tools: tool calling is not supported by jspec", param="tools")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise APIError("max_tokens and max_completion_tokens disagree", param="max_completion_tokens")
            self.max_tokens = self.max_completion_tokens

    def template_messages(self) -> list[dict]:
        return [m.as_template_input() for m in self.messages]


# ---------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, created: int, choices: list[dict], usage_: Optional[dict],
                    chunk: bool = False) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage_}
    if not chunk:
        body["system_fingerprint"] = None
    return body


def completion_choice(index: int, text: str, finish_reason: Optional[str]) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def chat_body(rid: str, model: str, created: int, choices: list[dict], usage_: Optional[dict],
              chunk: bool = False) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion", "created": created,
            "model": model, "choices": choices, "usage": usage_, "system_fingerprint": None}


def chat_choice(index: int, text: str, finish_reason: Optional[str]) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def chat_delta(index: int, delta: dict, finish_reason: Optional[str]) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def models_body(name: str, max_model_len: int, created: Optional[int] = None) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created or int(time.time()),
                                        "owned_by": "jspec", "root": name, "max_model_len": max_model_len}]}


def engine_error(e: JspecError) -> APIError:
    """A prompt or parameter the engine refused (too long for the context, bad token ids)."""
    return APIError(str(e), param="prompt" if "prompt" in str(e) or "token ids" in str(e) else None)


__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "error_body", "validation_message", "usage"]
