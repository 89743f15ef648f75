"""Constrained answers: a job line's grammar as an llguidance matcher per sequence, and the
token masks of a batch's rows.

klotski/io/requests.py reads a line's `response_format` / `structured_outputs` / `guided_*`
field into ``Request.constraint`` = (field, kind, text); `prepare` (klotski/schedule/sequences.py)
compiles it here with `compile_grammar`, and a grammar llguidance rejects is that line's error
record. In the step, the engine calls `mask` on a batch's logits before the pick and `start`
once the picked tokens are appended (`Grammar.advance` consumes each one): `start` computes the
next masks of every constrained row together on a worker thread (llguidance's parallel fill,
in Rust without the GIL) while the next forward runs, unpacked there to one boolean tensor, so
that `mask` waits for it and applies it with one `masked_fill_` for the whole batch. A batch
without a constrained row issues no op at all here.

Why llguidance (not xgrammar): docs/design.md, "Constrained answers".
"""
from __future__ import annotations

import json
import re
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

# JSON is written as json.dumps writes it (", " and ": ", no other whitespace): natural to a
# model, and a small or random model cannot wander in whitespace forever. A schema's own
# "x-guidance" options override these (llguidance applies defaults -> x-guidance -> overrides).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = {"json": "JSON schema", "regex": "regular expression", "choice": "list of choices",
         "grammar": "grammar (Lark or GBNF)"}
_SHIFTS = torch.arange(32, dtype=torch.int32)


class BadGrammar(Exception):
    """A line's constraint that llguidance cannot compile; the message is one line naming the field."""


@dataclass
class Grammar:
    """One sequence's constraint: its matcher, the logits width, the 32-bit words of a mask
    over llguidance's vocabulary (at least as wide), and the mask being computed for its next
    pick (a _Pending and this row's index in it)."""

    matcher: object  # llguidance.LLMatcher
    field: str
    vocab: int
    words: int
    pending: tuple[_Pending, int] | None = None

    def advance(self, token: int) -> str | None:
        """Consume the appended `token`: None while the answer may go on, "stop" once the
        grammar admits nothing more, else why the matcher failed (an error record)."""
        if not self.matcher.consume_token(token):
            return f"the constraint of {self.field} failed: {_one_line(self.matcher.get_error())}"
        return "stop" if self.matcher.is_stopped() else None


def compile_grammar(constraint: tuple[str, str, str], tokenizer, spec) -> Grammar:
    """A fresh matcher for `constraint` ((field, kind, text) from the job line); raises
    BadGrammar when llguidance rejects the schema, regex or grammar."""
    from llguidance import LLMatcher
    field, kind, text = constraint
    try:
        tok = _lltokenizer(tokenizer, spec)
    except BadGrammar as e:
        raise BadGrammar(f"{field}: {e}") from None
    key = (id(tok), kind, text)
    with _LOCK:
        owner, hit = _COMPILED.get(key, (None, None))
    if owner is not tok:  # (an id is only unique while its object lives: the entry keeps it)
        hit = _compile(tok, kind, text)
        with _LOCK:
            _COMPILED[key] = (tok, hit)
            while len(_COMPILED) > 64:  # many lines share a few grammars
                _COMPILED.pop(next(iter(_COMPILED)))
    if isinstance(hit, str):
        raise BadGrammar(f"{field} is not a usable {KINDS[kind]}: {hit}")
    with _LOCK:  # (prepare may run on several threads: the read-ahead, a server's)
        matcher: LLMatcher = hit.deep_copy()
    return Grammar(matcher, field, spec.shape.vocab_size, (tok.vocab_size + 31) // 32)


def mask(rows: list, logits: torch.Tensor) -> torch.Tensor:
    """`logits` [len(rows), V] with every constrained row's forbidden tokens at -inf, in place;
    waits for the masks `start` began (computing now those of rows that have none)."""
    live = [(i, s.grammar) for i, s in enumerate(rows) if s is not None and s.grammar is not None and not s.done]
    if not live:
        return logits  # nothing issued: an unconstrained step keeps its op count
    if any(g.pending is None for _, g in live):  # a first pick: its mask was not started yet
        start([s if s is not None and s.grammar is not None and s.grammar.pending is None else None for s in rows])
    sources = {id(g.pending[0]): g.pending[0] for _, g in live}
    only = next(iter(sources.values()))
    if len(sources) == 1 and only.rows == len(rows) and only.filled == {i for i, _ in live} \
            and all(g.pending[1] == i for i, g in live):
        forbid = only.result()  # every mask in its row and no other row masked: the static case
    else:  # rows moved or came from several batches (continuous batching): gather them
        forbid = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool)
        for key, pending in sources.items():
            pairs = [(i, g.pending[1]) for i, g in live if id(g.pending[0]) == key]
            forbid[[i for i, _ in pairs]] = pending.result()[[j for _, j in pairs]]
    for _, g in live:
        g.pending = None
    return logits.masked_fill_(forbid.to(logits.device, non_blocking=True), float("-inf"))


def start(rows: list) -> None:
    """Begin computing the next masks of `rows`' constrained, unfinished sequences (None: a
    row to skip), all in one tensor, on the worker thread."""
    live = [(i, s.grammar) for i, s in enumerate(rows)
            if s is not None and s.grammar is not None and not s.done]
    if not live:
        return
    first = live[0][1]
    pending = _Pending(len(rows), [(g.matcher, i) for i, g in live], first.words, first.vocab)
    for i, g in live:
        g.pending = (pending, i)


class _Pending:
    """The masks of one `start`: a future of a boolean tensor [rows, vocab], True = forbidden."""

    def __init__(self, rows: int, items: list, words: int, vocab: int):
        self.rows, self.filled = rows, {i for _, i in items}
        self.args = (rows, items, words, vocab)
        self.future: Future = _pool().submit(_fill, *self.args)

    def result(self) -> torch.Tensor:
        if self.future.cancel():  # the worker has not begun it (a busy CPU): no waiting, do it here
            return _fill(*self.args)
        return self.future.result()


def _fill(rows: int, items: list, words: int, vocab: int) -> torch.Tensor:
    bits = torch.full((rows, words), -1, dtype=torch.int32)  # rows left alone allow every token
    # llguidance.torch.fill_next_token_bitmask_par's one call, made directly: importing that
    # module sets up torch.compile for its own apply kernel, 1.5 s of a run's first mask
    _executor().unsafe_compute_mask_ptr(items, bits.data_ptr(), words * 4, rows)
    allowed = (bits.unsqueeze(-1) >> _SHIFTS) & 1
    return allowed.view(rows, -1)[:, :vocab] == 0


def _compile(tok, kind: str, text: str):
    """A compiled matcher, or the one-line reason llguidance gives for rejecting the text."""
    from llguidance import LLMatcher, grammar_from
    try:
        if kind == "json":
            grammar = LLMatcher.grammar_from_json_schema(text, defaults=JSON_STYLE)
        elif kind == "choice":
            grammar = grammar_from("choice", json.loads(text))
        else:
            grammar = grammar_from(kind, text)  # "regex", or "grammar": Lark, or GBNF converted
    except ValueError as e:
        return _one_line(str(e))
    matcher = LLMatcher(tok, grammar, log_level=0)
    if matcher.is_error():
        return _one_line(matcher.get_error())
    return matcher


_LOCK = threading.Lock()
_COMPILED: dict = {}  # (tokenizer, kind, text) -> (tokenizer, compiled matcher or its error); copied per line
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WORKER: dict = {}  # "pool": the one mask thread, "executor": llguidance's parallel fill


def _lltokenizer(tokenizer, spec):
    """llguidance's view of the model's tokenizer (about a second for a large vocabulary, so
    kept per tokenizer): as wide as the logits, ending at any of the model's EOS tokens."""
    import llguidance.hf
    eos = sorted(set(spec.eos_token_ids) | ({tokenizer.eos_token_id} - {None}))
    key = (spec.shape.vocab_size, tuple(eos))
    with _LOCK:
        known = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in known:
            try:
                known[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(spec.shape.vocab_size, len(tokenizer)),
                                                           eos_token=eos or None)
            except ValueError as e:  # a slow (Python) tokenizer
                raise BadGrammar(f"constrained answers need a fast tokenizer (tokenizer.json): {e}") from None
        return known[key]


def _pool() -> ThreadPoolExecutor:
    with _LOCK:
        if "pool" not in _WORKER:
            _WORKER["pool"] = ThreadPoolExecutor(1, thread_name_prefix="klotski-masks")
        return _WORKER["pool"]


def _executor():
    from llguidance import LLExecutor
    with _LOCK:
        if "executor" not in _WORKER:
            _WORKER["executor"] = LLExecutor()
        return _WORKER["executor"]


def _one_line(message: str) -> str:
    """llguidance's message without its source excerpt and caret lines, on one line."""
    lines = [x.strip() for x in message.split("<state>")[0].splitlines()]  # not its parser dump
    lines = [x for x in lines if x and not re.fullmatch(r"\^+|\d+ \|.*", x)]
    return " ".join(lines) or "rejected by llguidance"
