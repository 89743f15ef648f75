"""A streamed answer (`stream: true`) as OpenAI's chunks, token by token; klotski/serve/online.py
sends them as server-sent events. Nothing here waits or touches the engine: it is given what a
sample had made at some step (its tokens so far; its text and finish reason once done) and
says what to send.

* `TextStream`, one sample's text: detokenized incrementally (one decode of a few tokens per
  update, never the whole answer), with two things held back: a partial UTF-8
  character (a decode ending in U+FFFD waits for the token that completes it), and text that
  could still become one of the request's stop strings (the engine cuts a stop string and what
  follows it from the answer: no character of it may have been sent). The last delta is cut
  from the engine's own text of the finished sample, so the deltas join to exactly the
  non-streamed answer.
* `Chunks`, one request's chunks: chat's role first, content deltas, each choice's
  `finish_reason` with an empty delta, then (`stream_options.include_usage`) one chunk of
  `usage` with no choices, every other chunk carrying `"usage": null`; text completions the
  same without the role. `logprobs` per chunk hold the entries of the tokens whose text that
  chunk completes, shaped by klotski/io/records.py as the whole answer's are.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import deque

from klotski.io.records import chat_logprobs, completion_logprobs, prompt_tokens
from klotski.io.requests import CHAT_URL
from klotski.schedule.logprobs import pieces

PARTIAL = "\ufffd"  # what a decode shows for the bytes of a character not yet complete
DONE = "data: [DONE]\n\n"


def event(obj: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj)}\n\n"


def error_event(message: str, code: str, status: int = 500) -> str:
    """The event that ends a stream that cannot go on, in OpenAI's error shape (the `openai`
    client raises it as an APIError)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return event({"error": {"message": message, "type": kind, "param": None, "code": code}})


def releasable(text: str, stops: tuple[str, ...]) -> int:
    """How much of `text` can no longer become part of a stop string: all of it but its
    longest end that begins one (`text` holds no whole stop string: the engine ends a sample
    at one)."""
    longest = max(map(len, stops), default=0)
    for i in range(max(0, len(text) - longest + 1), len(text)):
        if any(stop.startswith(text[i:]) for stop in stops):
            return i
    return len(text)


class TextStream:
    """One sample's text as its tokens come (see the module doc). One decode per update, of a
    window of a few tokens: text is read from `start` on, the window's text so far (`window`)
    kept, so what a decode adds is the new tokens' text; the window moves on every few tokens,
    keeping CONTEXT tokens before the new ones. Linear in the answer's length, whatever comes."""

    WINDOW = 8    # tokens a decode window holds (besides those still waiting) before it moves on
    CONTEXT = 2   # tokens it keeps when it moves: a token's text can depend on the one before it
    PATIENCE = 8  # tokens a partial character may wait before each new one is first checked alone
    PROBE = 4     # ...with the last this many (at least a character's 4 bytes): bytes that never
                  # make a character (stray bytes) then cost no decode of the whole run each token

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.start = self.read = 0   # tokens: where the window starts, and how many are read
        self.window = ""             # the text of tokens [start, read)
        self.unsent = ""             # text read and not sent (what may yet begin a stop string)
        self.chars = self.sent = 0   # characters read, and sent
        self.tokens_sent = 0         # tokens whose text is all sent
        self.marks: deque[tuple[int, int]] = deque()  # (tokens read, characters read then), not yet sent

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _read(self, ids: list[int], n: int) -> None:
        """Take in tokens [read, n): their text is read unless it ends in a partial character,
        when they wait for the next (a special token adds no text and waits for nothing)."""
        if n <= self.read:
            return
        if n - self.read > self.PATIENCE and self._decode(ids[n - self.PROBE:n]).endswith(PARTIAL):
            return  # its end still partial: the whole window would be too
        text = self._decode(ids[self.start:n])
        if text.endswith(PARTIAL) or not text.startswith(self.window):
            return
        if new := text[len(self.window):]:
            self.unsent += new
            self.chars += len(new)
            self.marks.append((n, self.chars))
        self.read, self.window = n, text
        if n - self.start >= self.WINDOW:
            self.start = n - self.CONTEXT
            self.window = self._decode(ids[self.start:n])

    def next(self, ids: list[int], final: str | None = None, made: int | None = None) -> tuple[str, int, int]:
        """(the text to send now, and the range [a, b) of the tokens it completes), given the
        sample's tokens (its first `made`: all of them by default) and, once it is done, its
        whole text (`final`, the engine's)."""
        n, a = len(ids) if made is None else made, self.tokens_sent
        if final is not None:
            # the engine's text decides the end: what was sent is its beginning (held back as above)
            delta = final[self.sent:]
            self.sent, self.read, self.tokens_sent, self.unsent = len(final), n, n, ""
            self.marks.clear()
            return delta, a, n
        self._read(ids, n)
        upto = releasable(self.unsent, self.stop)  # (sent text never begins a stop string)
        delta, self.unsent = self.unsent[:upto], self.unsent[upto:]
        self.sent += upto
        while self.marks and self.marks[0][1] <= self.sent:
            self.tokens_sent = self.marks.popleft()[0]
        return delta, a, self.tokens_sent


class Chunks:
    """One streamed request's chunks (see the module doc); `samples` are its n sequences, in
    sample order."""

    def __init__(self, samples: list, tokenizer, url: str, model: str, *, usage: bool):
        self.samples, self.tokenizer, self.usage = samples, tokenizer, usage
        self.chat = url == CHAT_URL
        self.asked = getattr(samples[0].request, "logprobs", None) is not None
        self.head = {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": int(time.time()), "model": model}
        self.texts = [TextStream(tokenizer, s.stop) for s in samples]
        self.offsets = [0] * len(samples)  # a completion's logprobs' text_offset, where the next chunk's start
        self.made = [0] * len(samples)     # tokens each sample had made at its last progress

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {**self.head, "choices": choices}
        if self.usage:
            chunk["usage"] = usage
        return chunk

    def _choice(self, i: int, text: str | None, finish: str | None, logprobs: dict | None) -> dict:
        if self.chat:
            delta = {} if text is None else {"content": text}
            return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def opening(self) -> list[dict]:
        """Chat's first chunk of each choice: its role."""
        if not self.chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(len(self.samples))]

    def progress(self, i: int, made: int, finish: str | None = None, text: str | None = None) -> list[dict]:
        """The chunks for sample `i` having made `made` tokens; `finish` and `text` once it is
        done (its finish reason and whole text, as they were when it ended)."""
        s = self.samples[i]
        self.made[i] = made
        delta, a, b = self.texts[i].next(s.out, text if finish is not None else None, made)
        logprobs = self._logprobs(i, s.logprobs[a:b]) if self.asked and b > a else None
        out = [self._chunk([self._choice(i, delta, None, logprobs)])] if delta or logprobs else []
        if finish is not None:
            out.append(self._chunk([self._choice(i, None, finish, None)]))
        return out

    def _logprobs(self, i: int, entries: list) -> dict:
        named = pieces(self.tokenizer, [t for tok, _, alts in entries for t in (tok, *(a for a, _ in alts))])
        if self.chat:
            return chat_logprobs(entries, named)
        shaped = completion_logprobs(entries, named, self.offsets[i])
        if shaped["tokens"]:
            self.offsets[i] = shaped["text_offset"][-1] + len(shaped["tokens"][-1])
        return shaped

    def closing(self) -> list[dict]:
        """The usage chunk, where the request asked for it."""
        if not self.usage:
            return []
        prompt, made = prompt_tokens(self.samples), sum(self.made)
        return [self._chunk([], {"prompt_tokens": prompt, "completion_tokens": made,
                                 "total_tokens": prompt + made})]
