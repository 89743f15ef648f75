"""One job line: its three shapes, and the checks that turn it into a Request or a LineError.

* plain:  {"id": "q1", "prompt": "...", "max_new_tokens": 64, "temperature": 0.7,
           "top_p": 0.9, "stop": ["\\n\\n"], "seed": 1}
* chat:   {"id": "q2", "messages": [{"role": "user", "content": "..."}], ...}
* OpenAI batch: {"custom_id": "q3", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [...], "max_tokens": 64, ...}}

Unknown keys are ignored so that files can carry their own metadata, except the API fields
that would change the answer and are not implemented (`UNSUPPORTED`: tools, echo, ...):
a line setting one gets an error record naming it, so no answer silently differs from what
its line asked. ``n`` asks for that many samples, answered in one record; ``logprobs`` (and
chat's ``top_logprobs``) for each token's log-probability in OpenAI's shapes (`_logprobs`).
``response_format`` (OpenAI), ``structured_outputs`` (vLLM) or a ``guided_*`` alias constrain
the answer to a JSON schema, regex, choice or grammar (`_constraint`).
``top_k``, ``min_p``, the penalties, ``logit_bias``, ``min_tokens``, ``ignore_eos`` and
``stop_token_ids`` shape the pick (`sampling_fields`); ``chat_template_kwargs`` and
``reasoning_effort`` are the chat template's variables. A completions ``prompt`` may be a list
of texts or token ids (`_prompt`): one answer each, in one record.
``null`` for an optional field means "use the run's default". ``max_tokens`` (and OpenAI's
``max_completion_tokens``) is accepted as another name for ``max_new_tokens``.

Which id a line is answered under, and reading the file, are klotski/io/jobs.py's.

This module only uses the standard library (and klotski/io/strict_schema.py for strict mode's rules).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from klotski.io.strict_schema import strict_refusal

ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name for system, read as it
COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
MAX_TOKENS_KEYS = ("max_new_tokens", "max_tokens", "max_completion_tokens")  # one limit, three names
# The numeric sampling fields beyond temperature and top_p: (low, high, open_low), as vLLM
# (top_k, min_p, repetition_penalty) and OpenAI (presence and frequency) bound them.
SAMPLING_FIELDS = {"min_p": (0.0, 1.0, False), "repetition_penalty": (0.0, 2.0, True),
                   "presence_penalty": (-2.0, 2.0, False), "frequency_penalty": (-2.0, 2.0, False)}
OPTIONS = (*MAX_TOKENS_KEYS, "temperature", "top_p", "stop", "seed", "n", "logprobs",
           "top_logprobs", "choice_logprobs", "top_k", *SAMPLING_FIELDS, "logit_bias", "min_tokens", "ignore_eos",
           "stop_token_ids", "chat_template_kwargs", "reasoning_effort")  # what a line may set beside its prompt
MAX_N = 128  # samples per line (OpenAI's limit); prompts per completions line, the same
MAX_LOGIT_BIAS = 100  # OpenAI's: a bias in [-100, 100]
# apply_chat_template's own arguments: klotski sets them (or they do not apply), so a line may not
TEMPLATE_ARGUMENTS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                      "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # the openai package's literal
MAX_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS = 20, 5  # OpenAI's limits: chat's top_logprobs, completions' logprobs
# Request fields of the OpenAI and vLLM APIs that change the answer and that klotski does not
# implement, with the value that changes nothing (None: only absence or null does). A line
# setting one gets an error record naming it: ignored, its answer would silently differ from
# what was asked (vLLM ignores its removed guided_* fields so: vllm issue #53975).
UNSUPPORTED = {
    "best_of": 1, "echo": False, "suffix": None, "tools": [], "tool_choice": "none",
    "functions": [], "function_call": "none", "parallel_tool_calls": None,
    "prediction": None, "audio": None, "modalities": ["text"],
}
EXAMPLE_LINE = '{"id": "q1", "prompt": "Hello"}'
ROW_KEY = "_klotski_row"  # a dataset row's columns, carried beside its job fields (klotski/io/dataset_files.py)


@dataclass(frozen=True)
class Request:
    """One validated job.

    Exactly one of ``prompt`` / ``messages`` is set. ``prompt`` is a text, or a tuple of
    prompts (each a text or a tuple of token ids) where the line gave token ids or a list
    (OpenAI's completions: one answer per prompt; `prompts()` lists them). ``messages`` is a
    tuple of ``(role, content)`` string pairs, hashable like the rest of the request;
    ``chat_messages()`` gives the list-of-dicts form chat templates expect.
    ``None`` in a limit means "use the run's default"; the sampling fields' defaults change
    nothing (how they apply, and in which order: klotski/schedule/logits_processing.py).
    """

    id: str
    line: int
    prompt: str | tuple | None
    messages: tuple[tuple[str, str], ...] | None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1  # samples of this line, answered together in one record
    logprobs: int | None = None  # None: no log-probabilities; k: each token's, with its k most likely alternatives
    openai: str | None = None  # the endpoint ("/v1/chat/completions", ...) of an OpenAI Batch line
    constraint: tuple[str, str, str] | None = None  # (field, kind, text): the answer's grammar (`_constraint`)
    choice_logprobs: bool = False  # each option of its choice constraint scored (`_choice_logprobs`)
    top_k: int = 0  # 0: every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings held back until this many tokens
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    chat_template_kwargs: str | None = None  # JSON text of an object (hashable): the chat template's variables
    row: dict | None = field(default=None, compare=False, hash=False, repr=False)  # a dataset row's columns

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages or ()]

    def prompts(self) -> list:
        """The line's prompts, each a text or a tuple of token ids (one for a text line)."""
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt or ())

    def template_kwargs(self) -> dict:
        return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}


@dataclass(frozen=True)
class LineError:
    """A job that cannot be served; ``message`` says what is wrong and how to fix it.
    ``openai`` is the endpoint when the line was recognisably an OpenAI Batch request, and
    ``code`` the error code its OpenAI-form output line carries."""

    id: str
    line: int
    message: str
    openai: str | None = None
    code: str = "invalid_request"
    row: dict | None = field(default=None, compare=False, hash=False, repr=False)  # a dataset row's columns

    def __str__(self) -> str:
        return f"line {self.line} (id {self.id!r}): {self.message}"


def prompt_too_long(request: Request, prompt_tokens: int, context: int,
                    max_new_tokens: int | None = None) -> LineError:
    """The engine's error for a prompt that does not fit the model's context."""
    if max_new_tokens:
        message = (f"prompt has {prompt_tokens} tokens and max_new_tokens is {max_new_tokens}, "
                   f"together more than the model's context of {context} tokens; "
                   f"shorten the prompt or lower max_new_tokens")
    else:
        message = (f"prompt has {prompt_tokens} tokens, more than the model's context of "
                   f"{context} tokens; shorten the prompt")
    return LineError(request.id, request.line, message, openai=request.openai, code="context_length_exceeded",
                     row=request.row)


def model_error(seq) -> LineError:
    """The error of a sequence the model could not produce (e.g. non-finite logits)."""
    req = seq.request
    return LineError(req.id, req.line, seq.error, openai=req.openai, code="model_error", row=req.row)


# ---------------------------------------------------------------- checking one line


class InvalidLine(Exception):
    """A user-facing reason why one line is rejected."""


def is_openai(obj: dict) -> bool:
    return "body" in obj or "custom_id" in obj


def openai_endpoint(obj: dict) -> str | None:
    """The OpenAI endpoint a Batch line asks for (its url, else what its body implies)."""
    if not is_openai(obj):
        return None
    url, body = obj.get("url"), obj.get("body")
    if url in (COMPLETIONS_URL, CHAT_URL):
        return url
    return COMPLETIONS_URL if isinstance(body, dict) and body.get("prompt") is not None else CHAT_URL


def explicit_id(obj: dict) -> str | None:
    """The id a line states (``custom_id`` in the OpenAI form), as a string; None without one."""
    key = "custom_id" if is_openai(obj) else "id"
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise InvalidLine(f"{key} must be a string or a number, got {_show(value)}")
    if value == "":
        raise InvalidLine(f"{key} is empty; give a non-empty id or leave it out to use the line number")
    return str(value)


def line_fields(obj: dict) -> dict:
    """The Request fields of one line, apart from id and line."""
    prefix, src = "", obj
    if is_openai(obj):
        src, prefix = obj.get("body"), "body."
        if not isinstance(src, dict):
            raise InvalidLine('an OpenAI batch line needs a "body" object holding "prompt" or "messages"')
        _check_openai_envelope(obj, src)
    has_prompt = src.get("prompt") is not None
    has_messages = src.get("messages") is not None
    if has_prompt and has_messages:
        raise InvalidLine(f'give either {prefix}prompt or {prefix}messages, not both')
    if not has_prompt and not has_messages:
        raise InvalidLine(f'missing "{prefix}prompt" (or "{prefix}messages" for chat); '
                          f"e.g. {EXAMPLE_LINE}")
    for key, neutral in UNSUPPORTED.items():
        value = src.get(key)
        if value is not None and (neutral is None or value != neutral):
            raise InvalidLine(f"{prefix}{key} is not supported by klotski (it would change the answer); "
                              f"drop it from the line")
    prompt = _prompt(src["prompt"], prefix) if has_prompt else None
    messages = _messages(src["messages"], prefix) if has_messages else None
    max_new_tokens = _max_new_tokens(src, prefix)
    extra = sampling_fields(src, prefix, max_new_tokens)
    if has_prompt and not isinstance(prompt, str) and len(prompt) > 1 and src.get("choice_logprobs"):
        raise InvalidLine(f"{prefix}choice_logprobs scores one prompt's options; give {prefix}prompt as one prompt")
    if has_prompt and extra.get("chat_template_kwargs"):
        raise InvalidLine(f"{prefix}chat_template_kwargs and {prefix}reasoning_effort go to a chat template; "
                          f'give {prefix}messages, not {prefix}prompt')
    return dict(
        prompt=prompt,
        messages=messages,
        max_new_tokens=max_new_tokens,
        temperature=_number(src, "temperature", prefix, low=0.0, high=None, open_low=False),
        top_p=_number(src, "top_p", prefix, low=0.0, high=1.0, open_low=True),
        stop=_stop(src.get("stop"), prefix),
        seed=_seed(src.get("seed"), prefix),
        n=_n(src.get("n"), prefix),
        constraint=(constraint := _constraint(src, prefix)),
        choice_logprobs=_choice_logprobs(src.get("choice_logprobs"), constraint, prefix),
        logprobs=_logprobs(src, prefix, None if not is_openai(obj) else "completions" if has_prompt else "chat"),
        **extra,
    )


def _check_openai_envelope(obj: dict, body: dict) -> None:
    method = obj.get("method")
    if method is not None and method != "POST":
        raise InvalidLine(f'method must be "POST", got {_show(method)}')
    url = obj.get("url")
    if url is None:
        return
    if url not in (COMPLETIONS_URL, CHAT_URL):
        raise InvalidLine(f'url must be "{COMPLETIONS_URL}" or "{CHAT_URL}", got {_show(url)}')
    if url == COMPLETIONS_URL and body.get("messages") is not None:
        raise InvalidLine(f'url is {COMPLETIONS_URL} but body has "messages"; '
                          f"use {CHAT_URL} or give body.prompt")
    if url == CHAT_URL and body.get("prompt") is not None:
        raise InvalidLine(f'url is {CHAT_URL} but body has "prompt"; '
                          f"use {COMPLETIONS_URL} or give body.messages")


def _prompt(value, prefix: str) -> str | tuple:
    """A text; or OpenAI's completions forms: a list of texts, a list of token ids, a list of
    lists of token ids (a tuple of prompts, each a text or a tuple of ids)."""
    name = f"{prefix}prompt"
    if isinstance(value, str):
        if not value:
            raise InvalidLine(f"{name} is empty; give the text to continue")
        return value
    wanted = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if not isinstance(value, list) or not value:
        raise InvalidLine(f"{name} must be {wanted}, got {_show(value)}")
    if all(_is_int(t) for t in value):
        return (_token_ids(value, name),)
    if len(value) > MAX_N:
        raise InvalidLine(f"{name} holds {len(value)} prompts; give at most {MAX_N} in one line")
    if all(isinstance(t, str) for t in value):
        for i, text in enumerate(value):
            if not text:
                raise InvalidLine(f"{name}[{i}] is empty; give the text to continue")
        return tuple(value)
    if all(isinstance(t, list) for t in value):
        return tuple(_token_ids(ids, f"{name}[{i}]") for i, ids in enumerate(value))
    raise InvalidLine(f"{name} must be {wanted} (not a mix), got {_show(value)}")


def _token_ids(value: list, name: str) -> tuple[int, ...]:
    if not value or not all(_is_int(t) and t >= 0 for t in value):
        raise InvalidLine(f"{name} must be a non-empty list of token ids (integers >= 0), got {_show(value)}")
    return tuple(value)


def sampling_fields(src: dict, prefix: str, max_new_tokens: int | None) -> dict:
    """top_k, min_p, the penalties, logit_bias, min_tokens, ignore_eos, stop_token_ids and the chat
    template's variables of a line, checked against their ranges (a field left out or null: the
    default, which changes nothing). Token ids are checked against the vocabulary at tokenizing."""
    out = {}
    for key, (low, high, open_low) in SAMPLING_FIELDS.items():
        if (value := _number(src, key, prefix, low=low, high=high, open_low=open_low)) is not None:
            out[key] = value
    if (top_k := src.get("top_k")) is not None:
        if not _is_int(top_k) or top_k < -1:
            raise InvalidLine(f"{prefix}top_k must be an integer >= 1, or 0 or -1 for every token, got {_show(top_k)}")
        out["top_k"] = max(top_k, 0)
    if (bias := src.get("logit_bias")) is not None:
        out["logit_bias"] = _logit_bias(bias, f"{prefix}logit_bias")
    if (least := src.get("min_tokens")) is not None:
        high = max_new_tokens if max_new_tokens is not None else "max_tokens"
        if not _is_int(least) or least < 0 or (max_new_tokens is not None and least > max_new_tokens):
            raise InvalidLine(f"{prefix}min_tokens must be an integer in [0, {high}], got {_show(least)}")
        out["min_tokens"] = least
    if (ignore := src.get("ignore_eos")) is not None:
        if not isinstance(ignore, bool):
            raise InvalidLine(f"{prefix}ignore_eos must be true or false, got {_show(ignore)}")
        out["ignore_eos"] = ignore
    if (ids := src.get("stop_token_ids")) is not None:
        if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
            raise InvalidLine(f"{prefix}stop_token_ids must be a list of token ids (integers >= 0), got {_show(ids)}")
        out["stop_token_ids"] = tuple(dict.fromkeys(ids))
    kwargs = src.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidLine(f'{prefix}chat_template_kwargs must be an object like {{"enable_thinking": false}}, '
                          f"got {_show(kwargs)}")
    kwargs = dict(kwargs or {})
    if clash := sorted(set(kwargs) & TEMPLATE_ARGUMENTS):
        raise InvalidLine(f"{prefix}chat_template_kwargs.{clash[0]} is an argument of apply_chat_template, "
                          "not a variable of the template; drop it")
    if (effort := src.get("reasoning_effort")) is not None:  # OpenAI's, read by the templates that know it
        if effort not in REASONING_EFFORTS:
            raise InvalidLine(f"{prefix}reasoning_effort must be one of "
                              f"{', '.join(map(repr, REASONING_EFFORTS))}, got {_show(effort)}")
        if kwargs.get("reasoning_effort", effort) != effort:
            raise InvalidLine(f"{prefix}reasoning_effort and {prefix}chat_template_kwargs.reasoning_effort differ; "
                              "give one of them")
        kwargs["reasoning_effort"] = effort
    if kwargs:
        out["chat_template_kwargs"] = json.dumps(kwargs, sort_keys=True)
    return out


def _logit_bias(value, name: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (a JSON key, so a string) to a bias in [-100, 100]."""
    if not isinstance(value, dict):
        raise InvalidLine(f'{name} must be an object of token id -> bias, like {{"50256": -100}}, got {_show(value)}')
    out = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else \
            key if _is_int(key) and key >= 0 else None  # (a dataset row's map may keep integer keys)
        if token is None:
            raise InvalidLine(f"{name} keys must be token ids (integers >= 0), got {_show(key)}")
        if not (isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias)
                and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise InvalidLine(f"{name}[{key!r}] must be a number in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
                              f"got {_show(bias)}")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _messages(value, prefix: str) -> tuple[tuple[str, str], ...]:
    name = f"{prefix}messages"
    if not isinstance(value, list) or not value:
        raise InvalidLine(f'{name} must be a non-empty list like [{{"role": "user", "content": "Hi"}}], '
                          f"got {_show(value)}")
    pairs = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise InvalidLine(f'{name}[{i}] must be an object with "role" and "content", '
                              f"got {_show(message)}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise InvalidLine(f"{name}[{i}].role must be one of "
                              f"{', '.join(repr(r) for r in ROLES)}, got {_show(role)}")
        pairs.append(("system" if role == "developer" else role, _content(content, f"{name}[{i}].content")))
    return tuple(pairs)


def _content(content, name: str) -> str:
    """A message's text: a string, or OpenAI's list of text parts (joined by newlines, as vLLM does)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise InvalidLine(f'{name} must be a string or a list of parts like [{{"type": "text", "text": "Hi"}}], '
                          f"got {_show(content)}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidLine(f'{name}[{j}] must be a text part like {{"type": "text", "text": "Hi"}} (klotski '
                              f"reads text only), got {_show(part)}")
        texts.append(part["text"])
    return "\n".join(texts)


def _max_new_tokens(src: dict, prefix: str) -> int | None:
    given = [k for k in MAX_TOKENS_KEYS if src.get(k) is not None]
    if len(given) > 1:
        raise InvalidLine(f"give only one of {', '.join(prefix + k for k in given)}")
    if not given:
        return None
    key, value = prefix + given[0], src[given[0]]
    if not _is_int(value) or value < 1:
        raise InvalidLine(f"{key} must be an integer >= 1, got {_show(value)}")
    return value


def _number(src: dict, key: str, prefix: str, low: float, high: float | None,
            open_low: bool) -> float | None:
    value = src.get(key)
    if value is None:
        return None
    if high is None:
        wanted = f"a number >= {low:g}"
    else:
        wanted = f"a number in {'(' if open_low else '['}{low:g}, {high:g}]"
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and (value > low if open_low else value >= low)
          and (high is None or value <= high))
    if not ok:
        raise InvalidLine(f"{prefix}{key} must be {wanted}, got {_show(value)}")
    return float(value)


def _stop(value, prefix: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise InvalidLine(f'{prefix}stop must be a non-empty string or a list of them, like ["\\n\\n"], '
                          f"got {_show(value)}")
    return tuple(items)


def _seed(value, prefix: str) -> int | None:
    # Non-negative and 64-bit: what torch and numpy generators both accept.
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value < 2**64:
        raise InvalidLine(f"{prefix}seed must be an integer in [0, 2**64), got {_show(value)}")
    return value


def _n(value, prefix: str) -> int:
    if value is None:
        return 1
    if not _is_int(value) or not 1 <= value <= MAX_N:
        raise InvalidLine(f"{prefix}n must be an integer in [1, {MAX_N}], got {_show(value)}")
    return value


def _logprobs(src: dict, prefix: str, endpoint: str | None) -> int | None:
    """How many alternatives each token's log-probability comes with (None: none asked).
    OpenAI's two shapes: chat's ``logprobs: true`` with ``top_logprobs`` 0..20, completions'
    ``logprobs: k`` with k 0..5; a plain line (endpoint None) may give either, k up to 20."""
    value, top = src.get("logprobs"), src.get("top_logprobs")
    if endpoint == "completions" and top is not None:
        raise InvalidLine(f"{prefix}top_logprobs is a chat field; a completions body gives "
                          f"logprobs: k (0 to {MAX_COMPLETION_LOGPROBS}) instead")
    if _is_int(value):
        if endpoint == "chat":
            raise InvalidLine(f"{prefix}logprobs must be true or false in a chat body (top_logprobs gives "
                              f"how many alternatives), got {_show(value)}")
        high = MAX_COMPLETION_LOGPROBS if endpoint == "completions" else MAX_TOP_LOGPROBS
        if not 0 <= value <= high:
            raise InvalidLine(f"{prefix}logprobs must be an integer in [0, {high}], got {_show(value)}")
        if top is not None:
            raise InvalidLine(f"give {prefix}logprobs: k or {prefix}top_logprobs, not both")
        return value
    if value is not None and not isinstance(value, bool):
        raise InvalidLine(f"{prefix}logprobs must be true or false"
                          f"{' or an integer' if endpoint != 'chat' else ''}, got {_show(value)}")
    if endpoint == "completions" and value is True:
        raise InvalidLine(f"{prefix}logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}] in a "
                          f"completions body, got {_show(value)}")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise InvalidLine(f"{prefix}top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {_show(top)}")
    if not value:
        if top:  # alternatives asked without the log-probabilities they come with
            raise InvalidLine(f"{prefix}top_logprobs needs {prefix}logprobs: true")
        return None
    return top or 0


# ---------------------------------------------------------------- constrained answers
# Which grammar kind each constraint key gives (vLLM's structured_outputs keys and its older
# guided_* aliases); the grammar itself is compiled by klotski/schedule/constrain.py.
CONSTRAINT_KINDS = ("choice", "regex", "json", "grammar")


def _constraint(src: dict, prefix: str) -> tuple[str, str, str] | None:
    """The line's answer grammar as (field, kind, text), or None: OpenAI's `response_format`,
    vLLM's `structured_outputs` or a `guided_*` alias; at most one of them."""
    found = []
    if src.get("response_format") is not None:
        found.append(_response_format(src["response_format"], f"{prefix}response_format"))
    if src.get("structured_outputs") is not None:
        found.append(_structured_outputs(src["structured_outputs"], f"{prefix}structured_outputs"))
    for kind in CONSTRAINT_KINDS:
        if src.get(f"guided_{kind}") is not None:
            found.append(_grammar_of(kind, src[f"guided_{kind}"], f"{prefix}guided_{kind}"))
    found = [c for c in found if c is not None]
    if len(found) > 1:
        raise InvalidLine(f"give only one of {', '.join(c[0] for c in found)}: each constrains the whole answer")
    return found[0] if found else None


def _response_format(value, name: str) -> tuple[str, str, str] | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return (name, "json", '{"type": "object"}')
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise InvalidLine(f'{name}.json_schema must be an object with a "schema", like '
                              f'{{"name": "answer", "schema": {{"type": "object"}}}}, got {_show(spec)}')
        strict = spec.get("strict")
        if strict not in (None, True, False):
            raise InvalidLine(f"{name}.json_schema.strict must be true or false, got {_show(strict)}")
        found = _grammar_of("json", spec["schema"], f"{name}.json_schema.schema")
        refusal = strict and strict_refusal(json.loads(found[2]), found[0])
        if refusal:  # OpenAI refuses such a schema in strict mode: so do we, naming the rule
            raise InvalidLine(refusal)
        return found
    raise InvalidLine(f'{name} must be {{"type": "text"}}, {{"type": "json_object"}} or '
                      f'{{"type": "json_schema", "json_schema": {{"schema": ...}}}}, got {_show(value)}')


def _structured_outputs(value, name: str) -> tuple[str, str, str] | None:
    if not isinstance(value, dict):
        raise InvalidLine(f'{name} must be an object like {{"choice": ["yes", "no"]}}, got {_show(value)}')
    for key, given in value.items():  # its options that would shape the answer are not implemented
        if key not in (*CONSTRAINT_KINDS, "json_object") and given not in (None, False):
            raise InvalidLine(f"{name}.{key} is not supported by klotski (it would change the answer); "
                              f"give one of {', '.join(CONSTRAINT_KINDS)} or json_object")
    found = [_grammar_of(k, value[k], f"{name}.{k}") for k in CONSTRAINT_KINDS if value.get(k) is not None]
    if value.get("json_object") is True:
        found.append((f"{name}.json_object", "json", '{"type": "object"}'))
    if len(found) != 1:
        raise InvalidLine(f"{name} must give exactly one of {', '.join(CONSTRAINT_KINDS)} or json_object, "
                          f"got {_show(value)}")
    return found[0]


def _choice_logprobs(value, constraint, prefix: str) -> bool:
    """`choice_logprobs: true` asks for every option's log-probability (a label's confidence);
    it means something only beside a choice constraint."""
    if value is None or value is False:
        return False
    if value is not True:
        raise InvalidLine(f"{prefix}choice_logprobs must be true or false, got {_show(value)}")
    if constraint is None or constraint[1] != "choice":
        raise InvalidLine(f"{prefix}choice_logprobs scores the options of a choice: give it with "
                          f'{prefix}structured_outputs {{"choice": [...]}} or {prefix}guided_choice')
    return True


def _grammar_of(kind: str, value, name: str) -> tuple[str, str, str]:
    """(name, kind, text) with the shape of `value` checked; whether llguidance accepts the
    schema, regex or grammar is checked when it is compiled for the tokenizer."""
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidLine(f'{name} must be a non-empty list of non-empty strings, like ["yes", "no"], '
                              f"got {_show(value)}")
        return (name, kind, json.dumps(value))
    if kind == "json":
        if isinstance(value, str):  # vLLM also takes the schema as JSON text
            try:
                value = json.loads(value)
            except ValueError:
                raise InvalidLine(f"{name} must be a JSON schema (an object, or its JSON text), "
                                  f"got {_show(value)}") from None
        if not isinstance(value, (dict, bool)):
            raise InvalidLine(f"{name} must be a JSON schema (an object), got {_show(value)}")
        # the schema's own key order: the answer's keys come in it (a schema written reasoning-first
        # asks the model to reason before it answers), as in OpenAI's structured outputs
        return (name, kind, json.dumps(value))
    if not isinstance(value, str) or not value:
        what = "regular expression" if kind == "regex" else "grammar (Lark or GBNF)"
        raise InvalidLine(f"{name} must be a non-empty string holding a {what}, got {_show(value)}")
    return (name, kind, value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."
