"""Requests become sequences: tokenized prompts with their limits, sampling state and output.

Tokenizing happens one window of the job file at a time (klotski/generate.py); the first
window's is done before anything is planned or loaded, because the planner sizes memory by
its longest prompt. Deciding when a sequence is done (EOS, a stop string, its token limit)
also lives here (choosing the next token: schedule/sampling.py): the engine only calls them.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from klotski.execute.contract import StepInput

from klotski.schedule import constrain, logprobs


@dataclass
class Sequence:
    request: object            # klotski.io.requests.Request
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    generator: torch.Generator | None
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None  # why the model could not produce this sequence (an error record)
    top_logprobs: int | None = None  # None: its line asked no log-probabilities; k: alternatives per token
    logprobs: list = field(default_factory=list)  # (token, logprob, [(alternative, logprob), ...]) per out token
    pieces: dict | None = None  # token id -> (text, bytes) of the tokens in `logprobs`, once done
    sample: int = 0  # which of its line's n samples this is
    samples: list | None = None  # all n samples of its line (itself included), when n > 1
    grammar: constrain.Grammar | None = None  # the answer's constraint (klotski/schedule/constrain.py)
    # A label's confidence (`choice_logprobs`): one scoring row per option of the line's choice,
    # whose tokens are `forced` (the option as the tokenizer splits it, then EOS where the
    # grammar could go on) rather than picked; `scorers` lists them on every row of the line.
    forced: list[int] | None = None
    option: str | None = None
    scorers: list | None = None
    # Its source's ears (klotski/schedule/scheduler.py): `listener(seq)` is called on the engine's
    # thread after every step that added to `out` or ended it (a stream sends what is new);
    # `leaving` is set from any thread when nobody wants it any more (a client hung up): the
    # scheduler ends it at its next step (finish_reason "abort") and its row frees.
    listener: object = None
    leaving: bool = False
    priority: int = 1  # its source's place in the waiting queue (schedule/scheduler.py: ONLINE first)
    shared: int = 0  # prompt tokens the segments it starts from hold (schedule/prefix.py): not in its row
    chain: tuple = ()  # those segments, outermost first
    # Its line's sampling fields (klotski/io/requests.py; applied by schedule/logits_processing.py)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple = ()
    prompt_seen: torch.Tensor | None = None  # the prompt's distinct tokens, for the repetition penalty
    stop_from: int | None = None  # where stop strings are looked for, once min_tokens held them back

    def __post_init__(self):
        if self.repetition_penalty != 1.0 and self.prompt_seen is None:  # made once here, not in every step
            self.prompt_seen = torch.tensor(sorted(set(self.prompt_ids)), dtype=torch.long)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def prepare(requests, tokenizer, spec, config):
    """Tokenize; return (sequences, line errors): a prompt that is empty, too long for the
    model's context or rejected by the chat template, or a token id outside the vocabulary, is
    a line error. A line of P prompts and n samples is P x n sequences, sample p*n + j the j-th
    of prompt p (OpenAI's numbering of a completions list's choices), answered in one record."""
    from klotski.io.requests import LineError
    seqs, errors = [], []
    for req in requests:
        try:
            id_lists = [_prompt_ids(tokenizer, req, prompt, spec) for prompt in _inputs(req)]
        except _Refused as e:
            errors.append(e.error)
            continue
        except Exception as e:  # a chat template can reject a conversation
            errors.append(LineError(req.id, req.line, f"cannot tokenize: {e}", openai=req.openai, row=req.row))
            continue
        try:  # a schema, regex or grammar llguidance rejects is this line's error; each sample has its own matcher
            grammars = [constrain.compile_grammar(req.constraint, tokenizer, spec) if req.constraint else None
                        for _ in range(req.n * len(id_lists))]
        except constrain.BadGrammar as e:
            errors.append(LineError(req.id, req.line, str(e), openai=req.openai, row=req.row))
            continue
        ctx = spec.max_position_embeddings
        samples = [_sequence(req, ids, ctx, config, p * req.n + j) for p, ids in enumerate(id_lists) for j in range(req.n)]
        for s, grammar in zip(samples, grammars):
            s.grammar = grammar
        if len(samples) > 1:
            for s in samples:
                s.samples = samples
        seqs.extend(samples)
        if req.choice_logprobs:
            seqs.extend(_scorers(req, id_lists[0], ctx, config, tokenizer, spec, samples))
    return seqs, errors


class _Refused(Exception):
    def __init__(self, error):
        super().__init__(error.message)
        self.error = error


def _inputs(req) -> list:
    """What each of the line's prompts is tokenized from: its messages, or each prompt."""
    return [None] if req.messages is not None else req.prompts()


def _prompt_ids(tokenizer, req, prompt, spec) -> list[int]:
    """One prompt's token ids, with the line's checks that need the model: its context, its
    vocabulary (token ids given in the line too), the chat template's variables."""
    from klotski.io.requests import LineError, prompt_too_long

    def refuse(message: str):
        return _Refused(LineError(req.id, req.line, message, openai=req.openai, row=req.row))
    field, vocab = ("body." if req.openai else ""), spec.shape.vocab_size
    for name, ids in (("logit_bias", [t for t, _ in req.logit_bias]), ("stop_token_ids", req.stop_token_ids)):
        if ids and max(ids) >= vocab:
            raise refuse(f"{field}{name} has token id {max(ids)}, outside the model's vocabulary [0, {vocab})")
    if req.messages is not None:
        for key in req.template_kwargs():
            if not reads(tokenizer, key):
                name = "reasoning_effort" if key == "reasoning_effort" else f"chat_template_kwargs.{key}"
                raise refuse(f"{field}{name}: this model's chat template does not read {key!r}; drop it")
    ids = tokenize(tokenizer, req, prompt)
    ctx = spec.max_position_embeddings
    if len(ids) >= ctx:
        raise _Refused(prompt_too_long(req, len(ids), ctx))
    if not ids:
        raise refuse("prompt is empty after tokenization")
    if (top := max(ids)) >= vocab:
        raise refuse(f"{field}prompt has token id {top}, outside the model's vocabulary [0, {vocab})"
                     if isinstance(prompt, tuple) else
                     f"the prompt has token id {top}, outside the model's vocabulary (vocab_size {vocab} in "
                     "config.json): the tokenizer does not match the checkpoint")
    return ids


def reads(tokenizer, key: str) -> bool:
    """Whether the tokenizer's chat template(s) mention the variable `key` (a kwarg it never
    reads would be dropped without a word: refused instead)."""
    import re
    template = getattr(tokenizer, "chat_template", None) or ""
    text = " ".join(template.values()) if isinstance(template, dict) else str(template)
    return re.search(rf"\b{re.escape(key)}\b", text) is not None


def _scorers(req, ids, ctx, config, tokenizer, spec, samples) -> list[Sequence]:
    """The scoring rows of a line asking for its choice's log-probabilities: each option's
    tokens forced through the same grammar, their log-probabilities recorded (under the mask,
    before temperature: the logprob contract), EOS's too where another option could go on."""
    import json
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else spec.eos_token_ids[0]
    rows = []
    for option in json.loads(req.constraint[2]):
        s = _sequence(req, ids, ctx, config, -1)
        s.forced = list(tokenizer(option, add_special_tokens=False)["input_ids"]) + [eos]
        s.option, s.generator, s.top_logprobs, s.samples = option, None, 0, samples
        s.min_tokens, s.ignore_eos, s.stop_token_ids = 0, False, ()  # (its tokens are forced: nothing held back)
        s.max_new_tokens = min(len(s.forced), ctx - len(ids))
        s.grammar = constrain.compile_grammar(req.constraint, tokenizer, spec)
        rows.append(s)
    for s in [*samples, *rows]:
        s.scorers = rows
    return rows


def tokenize(tokenizer, req, prompt=None) -> list[int]:
    """The token ids of `req`'s messages (its chat template given its variables), or of
    `prompt` (a text, or token ids taken as they are; the line's first prompt by default)."""
    if req.messages is not None:
        out = tokenizer.apply_chat_template(req.chat_messages(), add_generation_prompt=True, tokenize=True,
                                            **req.template_kwargs())
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    prompt = req.prompts()[0] if prompt is None else prompt
    return list(prompt) if isinstance(prompt, tuple) else list(tokenizer(prompt)["input_ids"])


def _sequence(req, ids, ctx, config, sample: int = 0) -> Sequence:
    temperature = config.temperature if req.temperature is None else req.temperature
    gen = None
    if temperature > 0:
        seed = req.seed if req.seed is not None else _stable_seed(config.seed, req.id)
        if sample:  # sample i's own stream, from (seed, line id, i): the same whatever n and the batching
            seed = _stable_seed(seed, f"{req.id}#{sample}")
        gen = torch.Generator().manual_seed(seed)
    max_new = min(req.max_new_tokens or config.max_new_tokens, ctx - len(ids))
    # (the samples of a line share one prompt list: nothing changes it)
    return Sequence(req, ids, max_new, temperature, config.top_p if req.top_p is None else req.top_p,
                    tuple(req.stop), gen, top_logprobs=getattr(req, "logprobs", None), sample=sample,
                    **{f: getattr(req, f) for f in SAMPLING})


SAMPLING = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
            "min_tokens", "ignore_eos", "stop_token_ids")  # a line's fields each of its sequences carries


def gather(s: Sequence) -> list[Sequence] | None:
    """The samples of `s`'s line once all are done (in sample order; [s] for a line of one),
    else None: a line is answered in one record, whole or not at all."""
    answers = [s] if s.samples is None else s.samples
    return answers if all(x.done for x in [*answers, *(s.scorers or ())]) else None


def line_record(s: Sequence, *, fmt: str, model: str, include_token_ids: bool = False):
    """The one record of `s`'s line once all its samples are done, else None: (record, None),
    or (error record, its LineError) if a sample failed. Every writer (a job's output, a Ray
    worker's shard, klotski serve) gathers a line's samples through this."""
    from klotski.io.records import finished_record
    samples = gather(s)
    if samples is None:
        return None
    return finished_record(samples, fmt=fmt, model=model, include_token_ids=include_token_ids)


def append(s: Sequence, token: int, tokenizer, eos: set[int]) -> None:
    """Add `token` to `s` and decide whether `s` is done (EOS unless it ignores EOS, a stop
    token or string, its grammar complete, its limit). A stop string is looked for once `s`
    has min_tokens tokens, in the text from then on (vLLM's: one completed earlier does not
    count); EOS and stop tokens were held back from its pick until then."""
    if token in eos and not s.ignore_eos:
        s.finish_reason = "stop"
        if s.forced is None:  # (a scoring row keeps it: the option's end is part of its probability)
            del s.logprobs[len(s.out):]  # the EOS token is not part of the answer, nor its logprob
    else:
        s.out.append(token)
        if token in s.stop_token_ids:  # vLLM's: the stop token stays in the answer (its text unless special)
            s.finish_reason = "stop"
        elif s.stop and len(s.out) >= s.min_tokens:
            text = tokenizer.decode(s.out, skip_special_tokens=True)
            if s.min_tokens and s.stop_from is None:  # the text before the token that reached min_tokens
                s.stop_from = len(tokenizer.decode(s.out[:-1], skip_special_tokens=True))
            cut = min((i for i in (text.find(x, max(0, (s.stop_from or 0) - len(x) + 1)) for x in s.stop)
                       if i >= 0), default=-1)
            if cut >= 0:
                s.text, s.finish_reason = text[:cut], "stop"
                _name_tokens(s, tokenizer)
                return
        end = s.grammar.advance(token) if s.grammar is not None else None
        if end is not None and end != "stop":  # the matcher failed (a resource limit): this line's error
            fail(s, end)
            return
        if end == "stop":  # the grammar is complete: nothing may follow
            s.finish_reason = "stop"
        elif len(s.out) >= s.max_new_tokens and not s.done:
            s.finish_reason = "length"
    if s.done:
        s.text = tokenizer.decode(s.out, skip_special_tokens=True)
        _name_tokens(s, tokenizer)


def _name_tokens(s: Sequence, tokenizer) -> None:
    """The text and bytes of the tokens its logprobs name (its output has them), once done."""
    if s.top_logprobs is not None:
        s.pieces = logprobs.pieces(tokenizer, [t for tok, _, alts in s.logprobs for t in (tok, *(a for a, _ in alts))])


def abandon(s: Sequence) -> None:
    """End a sequence its source left (`leaving`): what it made so far stays in `out`."""
    s.finish_reason = "abort"
    notify(s)


def notify(s: Sequence) -> None:
    """Tell its source what is new (a token, its end), if it listens."""
    if s.listener is not None:
        s.listener(s)


def fail(s: Sequence, message: str) -> None:
    s.finish_reason, s.error = "error", message


def _stable_seed(seed: int, request_id: str) -> int:
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def prefill_input(batch: list[Sequence], length: int, pad: int) -> StepInput:
    """Left-pad prompts, less the tokens a shared prefix holds for each (`Sequence.shared`), to
    `length`; positions count real tokens only (cumsum(mask) - 1), after the prefix's."""
    ids = torch.full((len(batch), length), pad, dtype=torch.long)
    valid = torch.zeros((len(batch), length), dtype=torch.bool)
    for i, s in enumerate(batch):
        own = s.prompt_ids[s.shared:]
        ids[i, length - len(own):] = torch.tensor(own)
        valid[i, length - len(own):] = True
    skip = torch.tensor([s.shared for s in batch], dtype=torch.long)[:, None]
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0) + skip
    return StepInput(ids, valid, positions)


def chunks(inp: StepInput, size: int) -> list[StepInput]:
    """A prompt's columns in chunks of `size` (the last may be shorter)."""
    return [StepInput(inp.ids[:, a:a + size], inp.valid[:, a:a + size], inp.positions[:, a:a + size])
            for a in range(0, inp.ids.shape[1], size)]
