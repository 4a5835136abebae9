"""Request validation in OpenAI's terms: every bad field is a 400 in OpenAI's error format, found before
the request takes a place in the queue, so the worker only ever sees requests it can decode. The options the
API and the command line share (max_tokens, sampling, head) are checked by ``spechead.options``."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from spechead import options
from spechead.decoding.sampling import SamplingConfig
from spechead.errors import SpecheadError

MAX_BODY_BYTES = 16 << 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class ApiError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.kind = kind or {
            400: "invalid_request_error",
            404: "invalid_request_error",
            413: "invalid_request_error",
            499: "cancelled",
            503: "server_overloaded",
            504: "timeout_error",
        }.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Params:
    """A validated generation request."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stop: list[str]
    head: str
    stream: bool
    include_usage: bool


def is_int(x: Any) -> bool:
    """An int but not a bool (JSON's true would pass ``isinstance(x, int)``)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _field(body: dict, name: str, default: Any) -> Any:
    """A field's value, or ``default`` where the request leaves it out or sends null."""
    value = body.get(name)
    return default if value is None else value


@contextlib.contextmanager
def field_errors() -> Iterator[None]:
    """A ``SpecheadError`` from a ``spechead.options`` check as a 400 naming the field it is about."""
    try:
        yield
    except SpecheadError as e:
        raise ApiError(400, str(e), e.param) from None


# Options we do not implement: refuse non-default values rather than silently ignoring them.
UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "logprobs": None,
    "top_logprobs": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "tools": None,
    "functions": None,
    "suffix": None,
}


def check_unsupported(body: dict) -> None:
    """A 400 for the first option in ``UNSUPPORTED`` that asks for something other than its default."""
    for name, default in UNSUPPORTED.items():
        value = body.get(name)
        if value is None or value == default or (not value and default in (None, False)):
            continue
        raise ApiError(400, f"'{name}' = {json.dumps(value)[:60]} is not supported by this server", name)


def check_body(body: Any, model_name: str) -> dict:
    """The checks every endpoint shares once the JSON is parsed: an object, our model, streaming options."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", "model")
    if model != model_name:
        raise ApiError(404, f"model {model!r} not found; this server serves {model_name!r}", "model", "model_not_found")
    check_unsupported(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' must be {\"include_usage\": bool}", "stream_options")
    return body


def parse_sampling(body: dict, default_max_tokens: int) -> tuple[int, SamplingConfig, list[str]]:
    """max_tokens, the sampling config and the stop strings; OpenAI's defaults (temperature 1)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    with field_errors():
        max_tokens = options.max_new_tokens(_field(body, name, default_max_tokens), name)
        temperature, top_p = _field(body, "temperature", 1.0), _field(body, "top_p", 1.0)
        sampling = options.sampling(temperature, top_p, _field(body, "top_k", 0), body.get("seed"))
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings of up to {MAX_STOP_CHARS} characters", "stop")
    return max_tokens, sampling, stop


def parse_head(body: dict, default: str) -> str:
    """The draft head: top-level ``head`` or ``spechead: {"head": ...}`` (extra_body in the openai client)."""
    extra = body.get("spechead")
    if extra is not None and not isinstance(extra, dict):
        raise ApiError(400, "'spechead' must be an object", "spechead")
    head = body.get("head", (extra or {}).get("head"))
    if head is None:
        return default
    with field_errors():
        return options.head(head)  # the name and its options, before any decoder is built


def parse_params(body: dict, default_max_tokens: int, default_head: str) -> Params:
    """Everything but the prompt (``prompt_ids`` empty): checked before tokenizing, which costs more."""
    max_tokens, sampling, stop = parse_sampling(body, default_max_tokens)
    head = parse_head(body, default_head)
    opts = body.get("stream_options") or {}
    return Params(
        [],
        max_tokens,
        sampling,
        stop,
        head,
        body.get("stream", False),
        bool(opts.get("include_usage", False)),
    )


# roles a chat request may use -> the role the chat template sees (OpenAI's "developer" is the system prompt)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def parse_messages(body: dict) -> list[dict[str, str]]:
    """Chat turns as ``{"role", "content"}`` with the content as one string (text parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", "messages")
        if m["role"] not in ROLES:  # a template renders any role; an unknown one is a client's mistake
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}]: only text content parts are supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        turns.append({"role": ROLES[m["role"]], "content": content})
    return turns
