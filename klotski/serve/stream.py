"""A streamed answer (`stream: true`) as OpenAI's chunks, token by token; klotski/serve/online.py
sends them as server-sent events. Nothing here waits or touches the engine: it is given what a
sample had made at some step (its tokens so far; its text and finish reason once done) and
says what to send.

* `TextStream`, one sample's text: detokenized incrementally (a few tokens decoded again per
  step, as vLLM does, never the whole answer), with two things held back: a partial UTF-8
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

from klotski.io.records import chat_logprobs, completion_logprobs
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
    """One sample's text as its tokens come (see the module doc)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.prefix = self.read = 0  # tokens: where the decode window starts, and how many are in `text`
        self.text = ""               # the text of the first `read` tokens
        self.sent = 0                # characters of `text` sent
        self.tokens_sent = 0         # tokens whose text is all sent
        self.marks: list[tuple[int, int]] = []  # (tokens read, characters of text then), not yet sent

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _read(self, ids: list[int]) -> None:
        """Take in the tokens after `read`: their text joins `text` unless it ends in a partial
        character (or adds nothing: a special token), when they wait for the next."""
        if self.read >= len(ids):
            return
        # decoded from a few tokens back: a token's text can depend on the one before it
        # (SentencePiece's leading space, bytes of one character split over two tokens)
        before = self._decode(ids[self.prefix:self.read])
        after = self._decode(ids[self.prefix:])
        if len(after) > len(before) and not after.endswith(PARTIAL):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(ids)
            self.marks.append((self.read, len(self.text)))

    def next(self, ids: list[int], final: str | None = None) -> tuple[str, int, int]:
        """(the text to send now, and the range [a, b) of the tokens it completes), given the
        sample's tokens so far and, once it is done, its whole text (`final`, the engine's)."""
        a = self.tokens_sent
        if final is not None:
            # the engine's text decides the end: what was sent is its beginning (held back as above)
            delta = final[self.sent:]
            self.text, self.sent, self.read, self.tokens_sent, self.marks = final, len(final), len(ids), len(ids), []
            return delta, a, len(ids)
        self._read(ids)
        upto = max(self.sent, releasable(self.text, self.stop))
        delta, self.sent = self.text[self.sent:upto], upto
        while self.marks and self.marks[0][1] <= self.sent:
            self.tokens_sent = self.marks.pop(0)[0]
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
        delta, a, b = self.texts[i].next(s.out[:made], text if finish is not None else None)
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
        prompt, made = len(self.samples[0].prompt_ids), sum(self.made)
        return [self._chunk([], {"prompt_tokens": prompt, "completion_tokens": made,
                                 "total_tokens": prompt + made})]
