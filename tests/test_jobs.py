import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from klotski.io import jobs, output
from klotski.errors import JobFileError
from klotski.io.jobs import read_jobs
from klotski.io.output import OutputWriter
from klotski.io.records import error_record
from klotski.io.requests import LineError, Request, prompt_too_long

REPO = Path(__file__).resolve().parents[1]


def write_lines(path, lines):
    """Job file from a list of dicts (dumped) and str/bytes (written as they are)."""
    out = b""
    for line in lines:
        if isinstance(line, dict):
            line = json.dumps(line)
        out += (line.encode() if isinstance(line, str) else line) + b"\n"
    path.write_bytes(out)
    return path


def read_records(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------- formats


def test_plain_line_with_every_option(tmp_path):
    path = write_lines(tmp_path / "j.jsonl", [
        {"id": "q1", "prompt": "Hello", "max_new_tokens": 5, "temperature": 0.7,
         "top_p": 0.9, "stop": ["\n\n", "END"], "seed": 3, "meta": {"kept": "ignored"}},
        {"id": "q2", "prompt": "Bye", "stop": "."},
    ])
    requests, errors = read_jobs(path)
    assert errors == []
    assert requests == [
        Request("q1", 1, "Hello", None, 5, 0.7, 0.9, ("\n\n", "END"), 3),
        Request("q2", 2, "Bye", None, None, None, None, (".",), None),
    ]


def test_plain_defaults_and_nulls_mean_run_default(tmp_path):
    path = write_lines(tmp_path / "j.jsonl", [
        {"id": "a", "prompt": "x", "temperature": None, "max_new_tokens": None, "stop": None},
        {"id": "b", "prompt": "x", "max_tokens": 7, "temperature": 0},
    ])
    (a, b), errors = read_jobs(path)
    assert errors == []
    assert (a.max_new_tokens, a.temperature, a.top_p, a.stop, a.seed) == (None, None, None, (), None)
    assert b.max_new_tokens == 7 and b.temperature == 0.0 and isinstance(b.temperature, float)


def test_chat_line(tmp_path):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Again", "name": "extra keys are dropped"}]
    path = write_lines(tmp_path / "j.jsonl", [{"id": "c1", "messages": msgs, "max_new_tokens": 9}])
    (req,), errors = read_jobs(path)
    assert errors == []
    assert req.prompt is None
    assert req.messages == (("system", "Be brief."), ("user", "Hi"),
                            ("assistant", "Hello"), ("user", "Again"))
    assert req.chat_messages()[1] == {"role": "user", "content": "Hi"}
    assert req.max_new_tokens == 9
    hash(req)  # frozen and hashable, messages included


def test_openai_batch_lines(tmp_path):
    path = write_lines(tmp_path / "j.jsonl", [
        {"custom_id": "r1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": "Once", "max_tokens": 12, "temperature": 0.5,
                  "top_p": 1, "stop": "\n", "seed": 42}},
        {"custom_id": "r2", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                  "max_completion_tokens": 4}},
        {"custom_id": 17, "body": {"prompt": "no url: inferred"}},
    ])
    requests, errors = read_jobs(path)
    assert errors == []
    r1, r2, r3 = requests
    assert (r1.id, r1.prompt, r1.max_new_tokens, r1.temperature, r1.top_p, r1.stop, r1.seed) == \
        ("r1", "Once", 12, 0.5, 1.0, ("\n",), 42)
    assert (r2.id, r2.messages, r2.max_new_tokens) == ("r2", (("user", "Hi"),), 4)
    assert r3.id == "17"


def test_missing_and_numeric_ids_blank_lines_and_line_numbers(tmp_path):
    path = write_lines(tmp_path / "j.jsonl", [
        {"prompt": "first"},
        "",
        "   \t",
        {"id": 7, "prompt": "numeric"},
        {"id": 2.5, "prompt": "float id"},
        {"prompt": "sixth line"},
    ])
    requests, errors = read_jobs(path)
    assert errors == []
    assert [(r.id, r.line) for r in requests] == [("1", 1), ("7", 4), ("2.5", 5), ("6", 6)]


def test_bom_crlf_and_unicode_line_separator_inside_strings(tmp_path):
    # U+2028 is a line break for str.splitlines but legal inside a JSON string.
    text = '{"id": "a", "prompt": "x\u2028y é"}\r\n{"id": "b", "prompt": "z"}\r\n'
    path = tmp_path / "j.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    requests, errors = read_jobs(path)
    assert errors == []
    assert [(r.id, r.prompt, r.line) for r in requests] == [("a", "x\u2028y é", 1), ("b", "z", 2)]


# ---------------------------------------------------------------- bad input

BAD_LINES = [
    ('{"id": "x", "prompt": "a"', "invalid JSON at column"),
    ('{"id": "x", "prompt": "a"} trailing', "invalid JSON at column 28"),
    ('["id", "prompt"]', "JSON array, not an object"),
    ('"just a string"', "JSON string, not an object"),
    ({"id": "x"}, 'missing "prompt"'),
    ({"id": "x", "prompt": ""}, "prompt is empty"),
    ({"id": "x", "prompt": ["a", 3]}, "prompt must be a string, a list of strings, a list of token ids"),
    ({"id": "x", "prompt": [1, -2]}, "prompt must be a non-empty list of token ids (integers >= 0)"),
    ({"id": "x", "prompt": [[1], []]}, "prompt[1] must be a non-empty list of token ids"),
    ({"id": "x", "prompt": ["a", ""]}, "prompt[1] is empty"),
    ({"id": "x", "prompt": ["a"] * 129}, "prompt holds 129 prompts; give at most 128"),
    ({"id": "x", "prompt": "a", "messages": [{"role": "user", "content": "b"}]},
     "either prompt or messages"),
    ({"id": "x", "prompt": "a", "max_new_tokens": "ten"}, 'max_new_tokens must be an integer >= 1, got "ten"'),
    ({"id": "x", "prompt": "a", "max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"id": "x", "prompt": "a", "max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
    ({"id": "x", "prompt": "a", "max_new_tokens": True}, "max_new_tokens must be an integer"),
    ({"id": "x", "prompt": "a", "max_new_tokens": 3, "max_tokens": 4}, "give only one of"),
    ({"id": "x", "prompt": "a", "temperature": -1}, "temperature must be a number >= 0, got -1"),
    ('{"id": "x", "prompt": "a", "temperature": NaN}', "temperature must be a number"),
    ({"id": "x", "prompt": "a", "temperature": "hot"}, "temperature must be a number"),
    ({"id": "x", "prompt": "a", "top_p": 2}, "top_p must be a number in (0, 1], got 2"),
    ({"id": "x", "prompt": "a", "top_p": 0}, "top_p must be a number in (0, 1]"),
    ({"id": "x", "prompt": "a", "stop": 5}, "stop must be a non-empty string or a list"),
    ({"id": "x", "prompt": "a", "stop": ["ok", 3]}, "stop must be"),
    ({"id": "x", "prompt": "a", "stop": ""}, "stop must be"),
    ({"id": "x", "prompt": "a", "seed": -1}, "seed must be an integer"),
    ({"id": "x", "prompt": "a", "seed": "1"}, "seed must be an integer"),
    ({"id": "x", "messages": []}, "messages must be a non-empty list"),
    ({"id": "x", "messages": "hi"}, "messages must be a non-empty list"),
    ({"id": "x", "messages": ["hi"]}, "messages[0] must be an object"),
    ({"id": "x", "messages": [{"role": "bot", "content": "hi"}]}, 'messages[0].role must be one of'),
    ({"id": "x", "messages": [{"role": "user", "content": "a"}, {"role": "user"}]},
     "messages[1].content must be a string or a list of parts"),
    ({"id": "x", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0] must be a text part"),
    ({"id": ["x"], "prompt": "a"}, "id must be a string or a number"),
    ({"id": "", "prompt": "a"}, "id is empty"),
    ({"custom_id": "x", "url": "/v1/completions"}, 'needs a "body" object'),
    ({"custom_id": "x", "url": "/v1/embeddings", "body": {"prompt": "a"}}, "url must be"),
    ({"custom_id": "x", "method": "GET", "body": {"prompt": "a"}}, 'method must be "POST"'),
    ({"custom_id": "x", "url": "/v1/completions", "body": {"messages": [{"role": "user", "content": "a"}]}},
     "use /v1/chat/completions"),
    ({"custom_id": "x", "body": {"prompt": "a", "max_tokens": "ten"}}, "body.max_tokens must be an integer"),
    ({"custom_id": "x", "body": {"prompt": "a", "n": 0}}, "body.n must be an integer in [1, 128], got 0"),
    ({"id": "x", "prompt": "a", "n": 2.5}, "n must be an integer in [1, 128]"),
    ({"id": "x", "prompt": "a", "n": 129}, "n must be an integer in [1, 128]"),
    # log-probabilities in OpenAI's two shapes, out of range or mixed up: the field is named
    ({"custom_id": "x", "body": {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
                                 "top_logprobs": 21}}, "body.top_logprobs must be an integer in [0, 20], got 21"),
    ({"custom_id": "x", "body": {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 5}},
     "body.top_logprobs needs body.logprobs: true"),
    ({"custom_id": "x", "body": {"messages": [{"role": "user", "content": "a"}], "logprobs": 3}},
     "body.logprobs must be true or false in a chat body"),
    ({"custom_id": "x", "body": {"prompt": "a", "logprobs": 6}}, "body.logprobs must be an integer in [0, 5], got 6"),
    ({"custom_id": "x", "body": {"prompt": "a", "logprobs": -1}}, "body.logprobs must be an integer in [0, 5]"),
    ({"custom_id": "x", "body": {"prompt": "a", "logprobs": True}}, "body.logprobs must be an integer in [0, 5]"),
    ({"custom_id": "x", "body": {"prompt": "a", "logprobs": 2, "top_logprobs": 2}}, "body.top_logprobs is a chat"),
    ({"id": "x", "prompt": "a", "logprobs": 21}, "logprobs must be an integer in [0, 20], got 21"),
    ({"id": "x", "prompt": "a", "logprobs": "yes"}, "logprobs must be true or false or an integer"),
    ({"id": "x", "prompt": "a", "logprobs": True, "top_logprobs": -2}, "top_logprobs must be an integer in [0, 20]"),
    # the sampling fields out of their ranges: the field and its range named
    ({"custom_id": "x", "body": {"prompt": "a", "logit_bias": {"50256": -101}}},
     "body.logit_bias['50256'] must be a number in [-100, 100], got -101"),
    ({"id": "x", "prompt": "a", "logit_bias": {"a": 1}}, 'logit_bias keys must be token ids (integers >= 0), got "a"'),
    ({"id": "x", "prompt": "a", "logit_bias": [1]}, "logit_bias must be an object of token id -> bias"),
    ({"id": "x", "prompt": "a", "presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2], got 2.5"),
    ({"id": "x", "prompt": "a", "frequency_penalty": -3}, "frequency_penalty must be a number in [-2, 2], got -3"),
    ({"id": "x", "prompt": "a", "repetition_penalty": 0}, "repetition_penalty must be a number in (0, 2], got 0"),
    ({"id": "x", "prompt": "a", "min_p": 1.5}, "min_p must be a number in [0, 1], got 1.5"),
    ({"id": "x", "prompt": "a", "top_k": -2}, "top_k must be an integer >= 1, or 0 or -1 for every token, got -2"),
    ({"id": "x", "prompt": "a", "top_k": 2.5}, "top_k must be an integer >= 1"),
    ({"id": "x", "prompt": "a", "min_tokens": 5, "max_tokens": 4}, "min_tokens must be an integer in [0, 4], got 5"),
    ({"id": "x", "prompt": "a", "min_tokens": -1}, "min_tokens must be an integer in [0, max_tokens], got -1"),
    ({"id": "x", "prompt": "a", "ignore_eos": "yes"}, 'ignore_eos must be true or false, got "yes"'),
    ({"id": "x", "prompt": "a", "stop_token_ids": [1, "2"]}, "stop_token_ids must be a list of token ids"),
    ({"id": "x", "prompt": "a", "chat_template_kwargs": {"enable_thinking": False}},
     "chat_template_kwargs and reasoning_effort go to a chat template; give messages, not prompt"),
    ({"id": "x", "messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": ["x"]},
     "chat_template_kwargs must be an object"),
    ({"id": "x", "messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"tokenize": False}},
     "chat_template_kwargs.tokenize is an argument of apply_chat_template"),
    ({"custom_id": "x", "body": {"messages": [{"role": "user", "content": "a"}], "reasoning_effort": "huge"}},
     "body.reasoning_effort must be one of 'none', 'minimal', 'low', 'medium', 'high', 'xhigh', 'max', got \"huge\""),
    ({"id": "x", "prompt": ["a", "b"], "guided_choice": ["y", "n"], "choice_logprobs": True},
     "choice_logprobs scores one prompt's options"),
    # fields that would change the answer and are not implemented: never silently ignored
    ({"custom_id": "x", "body": {"prompt": "a", "best_of": 3}}, "body.best_of is not supported"),
    ({"custom_id": "x", "body": {"prompt": "a", "echo": True}}, "body.echo is not supported"),
    ({"custom_id": "x", "body": {"messages": [{"role": "user", "content": "a"}],
                                 "tools": [{"type": "function", "function": {"name": "f"}}]}}, "body.tools is not"),
    ({"custom_id": "x", "body": {"messages": [{"role": "user", "content": "a"}], "tool_choice": "auto"}},
     "body.tool_choice is not supported"),
    ({"custom_id": "x", "body": {"messages": [{"role": "user", "content": "a"}],
                                 "response_format": {"type": "grammar"}}}, "body.response_format must be"),
    ({"id": "x", "prompt": "a", "structured_outputs": {"structural_tag": "t"}},
     "structured_outputs.structural_tag is not"),
    ({"id": "x", "prompt": "a", "guided_choice": "yes"}, "guided_choice must be a non-empty list"),
]


@pytest.mark.parametrize("bad, expected", BAD_LINES, ids=[m for _, m in BAD_LINES])
def test_bad_line_is_reported_and_others_survive(tmp_path, bad, expected):
    path = write_lines(tmp_path / "j.jsonl", [
        {"id": "before", "prompt": "ok"}, bad, {"id": "after", "prompt": "ok"}])
    requests, errors = read_jobs(path)
    assert [(r.id, r.line) for r in requests] == [("before", 1), ("after", 3)]
    assert len(errors) == 1
    err = errors[0]
    assert err.line == 2
    assert expected in err.message
    assert "\n" not in err.message
    assert err.id not in {"before", "after"}
    assert error_record(err, fmt="klotski") == {"id": err.id, "error": {"line": 2, "message": err.message}}


def test_fields_that_change_nothing_are_accepted(tmp_path):
    """Their neutral values, and the fields that never change an answer (model, user,
    metadata), are not errors: a client that sends its defaults keeps working."""
    body = {"messages": [{"role": "user", "content": "a"}], "model": "m", "user": "u", "metadata": {"k": "v"},
            "logprobs": False, "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {}, "tools": [],
            "response_format": {"type": "text"}, "echo": False, "best_of": 1, "n": 1, "top_logprobs": None}
    path = write_lines(tmp_path / "j.jsonl", [{"custom_id": "x", "body": body},
                                              {"id": "y", "prompt": "a", "logprobs": None, "top_k": -1}])
    requests, errors = read_jobs(path)
    assert errors == [] and [r.id for r in requests] == ["x", "y"]


def test_n_and_logprobs_in_every_shape(tmp_path):
    """n samples and log-probabilities: chat's logprobs true + top_logprobs, completions'
    logprobs k, and a plain line's either; off is None, not 0 (0: the token's own only)."""
    chat = [{"role": "user", "content": "a"}]
    path = write_lines(tmp_path / "j.jsonl", [
        {"custom_id": "c", "body": {"messages": chat, "logprobs": True, "top_logprobs": 20, "n": 3}},
        {"custom_id": "c0", "body": {"messages": chat, "logprobs": True}},
        {"custom_id": "t", "body": {"prompt": "a", "logprobs": 5, "n": 1}},
        {"custom_id": "t0", "body": {"prompt": "a", "logprobs": 0}},
        {"custom_id": "off", "body": {"prompt": "a", "logprobs": False}},
        {"id": "p", "prompt": "a", "logprobs": 7, "n": 128},
        {"id": "q", "prompt": "a", "logprobs": True, "top_logprobs": 2},
        {"id": "r", "prompt": "a", "top_logprobs": 0}])
    requests, errors = read_jobs(path)
    assert errors == []
    assert [(r.id, r.n, r.logprobs) for r in requests] == [
        ("c", 3, 20), ("c0", 1, 0), ("t", 1, 5), ("t0", 1, 0), ("off", 1, None), ("p", 128, 7), ("q", 1, 2),
        ("r", 1, None)]


def test_error_keeps_the_id_it_could_read(tmp_path):
    path = write_lines(tmp_path / "j.jsonl", [
        {"id": "t", "prompt": "a", "top_p": 5}, "{broken", {"prompt": "fine"}])
    requests, errors = read_jobs(path)
    assert [r.id for r in requests] == ["3"]
    assert [(e.id, e.line) for e in errors] == [("t", 1), ("2", 2)]


def test_non_utf8_line_spoils_only_itself(tmp_path):
    path = write_lines(tmp_path / "j.jsonl", [
        {"id": "a", "prompt": "é"},
        b'{"id": "b", "prompt": "caf\xe9"}',
        {"id": "c", "prompt": "ok"},
    ])
    requests, errors = read_jobs(path)
    assert [r.id for r in requests] == ["a", "c"]
    assert requests[0].prompt == "é"
    (err,) = errors
    assert err.line == 2 and err.id == "2"
    assert "not valid UTF-8" in err.message and "0xe9" in err.message and "column 27" in err.message


def test_duplicate_ids_first_in_file_order_wins_and_error_ids_stay_unique(tmp_path):
    path = write_lines(tmp_path / "j.jsonl", [
        {"id": "a", "prompt": "first"},
        {"id": "b", "prompt": "x"},
        {"id": "a", "prompt": "second"},
        {"id": "a", "prompt": "third"},
        {"prompt": "no id, line 5"},
        {"id": 5, "prompt": "explicit 5, claimed earlier by line 5"},
        "{not json",  # line 7: claims its default id "7" first
        {"id": "7", "prompt": "explicit"},
        {"id": "a#line3", "prompt": "takes a name an error record already has"},
    ])
    requests, errors = read_jobs(path)
    assert [(r.id, r.prompt) for r in requests] == [("a", "first"), ("b", "x"), ("5", "no id, line 5")]
    by_line = {e.line: e for e in errors}
    assert sorted(by_line) == [3, 4, 6, 7, 8, 9]
    assert "duplicate id 'a'" in by_line[3].message and by_line[3].id == "a#line3"
    assert "duplicate id 'a'" in by_line[4].message and by_line[4].id == "a#line4"
    assert "duplicate id '5'" in by_line[6].message and by_line[6].id == "5#line6"
    assert "invalid JSON" in by_line[7].message and by_line[7].id == "7"
    assert "duplicate id '7'" in by_line[8].message
    assert "duplicate id 'a#line3'" in by_line[9].message
    all_ids = [r.id for r in requests] + [e.id for e in errors]
    assert len(all_ids) == len(set(all_ids))


def test_a_line_without_id_whose_number_is_taken_is_an_error(tmp_path):
    path = write_lines(tmp_path / "j.jsonl", [{"id": 2, "prompt": "explicit 2"}, {"prompt": "line 2, no id"}])
    (req,), (err,) = read_jobs(path)
    assert req.id == "2" and err.line == 2 and err.id == "2#line2"
    assert "no id" in err.message and "already used by an earlier line" in err.message


def test_missing_job_file_or_directory(tmp_path):
    with pytest.raises(JobFileError, match="does not exist"):
        read_jobs(tmp_path / "nope.jsonl")
    with pytest.raises(JobFileError, match="is a directory"):
        read_jobs(tmp_path)


def test_prompt_too_long_helper():
    req = Request("q", 4, "long", None)
    err = prompt_too_long(req, 5000, 4096)
    assert isinstance(err, LineError) and (err.id, err.line) == ("q", 4)
    assert "5000 tokens" in err.message and "4096" in err.message
    err = prompt_too_long(req, 4000, 4096, max_new_tokens=200)
    assert "max_new_tokens is 200" in err.message
    assert error_record(err, fmt="klotski")["error"] == {"line": 4, "message": err.message}


@pytest.mark.parametrize("module", [jobs, output])
def test_job_and_output_modules_use_only_the_standard_library(module):
    tree = ast.parse(Path(module.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported and imported <= set(sys.stdlib_module_names) | {"klotski"}, imported


# ---------------------------------------------------------------- writing


def same(ids, expected) -> bool:
    """An IdSet holds exactly `expected` (as far as membership and size can tell)."""
    return len(ids) == len(expected) and all(rid in ids for rid in expected)


def ok(rid, text="done"):
    return {"id": rid, "completion": text, "finish_reason": "stop",
            "prompt_tokens": 3, "completion_tokens": 1}


def test_writer_writes_one_utf8_line_per_record(tmp_path):
    out = tmp_path / "sub" / "out.jsonl"  # parent is created
    with OutputWriter(out) as w:
        assert same(w.done_ids, set())
        assert w.write(ok("a", "héllo ✓\nline"))
        assert w.write(error_record(LineError("b", 2, "bad"), fmt="klotski"))
    raw = out.read_bytes()
    assert raw.count(b"\n") == 2 and raw.endswith(b"\n")
    assert "héllo ✓".encode() in raw  # ensure_ascii=False
    assert read_records(out) == [ok("a", "héllo ✓\nline"),
                                 {"id": "b", "error": {"line": 2, "message": "bad"}}]


def test_writer_never_writes_an_id_twice(tmp_path):
    out = tmp_path / "out.jsonl"
    with OutputWriter(out) as w:
        assert w.write(ok("a")) is True
        assert w.write(ok("a", "again")) is False
        assert w.write(error_record(LineError("a", 1, "late error"), fmt="klotski")) is False
        assert w.duplicates == 2 and "a" in w
    with OutputWriter(out) as w:
        assert w.write(ok("a", "third")) is False  # also across runs
    assert read_records(out) == [ok("a")]


def test_writer_rejects_records_without_id_and_nan(tmp_path):
    with OutputWriter(tmp_path / "out.jsonl") as w:
        with pytest.raises(ValueError):
            w.write({"completion": "x"})
        with pytest.raises(ValueError):
            w.write({"id": "n", "score": float("nan")})
        assert w.write({"id": "n", "completion": "fine"})  # the failed attempt left no trace
    assert read_records(tmp_path / "out.jsonl") == [{"id": "n", "completion": "fine"}]


def test_writer_escapes_lone_surrogates(tmp_path):
    out = tmp_path / "out.jsonl"
    with OutputWriter(out) as w:
        w.write(ok("s", "bad \udc80 byte"))
    (rec,) = read_records(out)
    assert rec["completion"] == "bad \udc80 byte"


def test_failed_write_leaves_no_half_line(tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    real_write = os.write
    with OutputWriter(out) as w:
        w.write(ok("a"))

        def disk_full(fd, data):
            real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(output.os, "write", disk_full)
        with pytest.raises(OSError):
            w.write(ok("b"))
        monkeypatch.setattr(output.os, "write", real_write)
        assert "b" not in w
        assert w.write(ok("c"))
    assert read_records(out) == [ok("a"), ok("c")]


def test_resume_skips_done_ids_and_retries_errors(tmp_path):
    out = tmp_path / "out.jsonl"
    with OutputWriter(out) as w:
        w.write(ok("a"))
        w.write(error_record(LineError("b", 2, "temperature must be ..."), fmt="klotski"))
        w.write(ok("c"))
    with OutputWriter(out) as w:
        assert same(w.done_ids, {"a", "c"})
        assert w.retried == 1
        assert "b" not in w
        assert w.write(ok("b", "fixed")) is True
        assert w.write(ok("a", "again")) is False
    recs = read_records(out)
    assert [r["id"] for r in recs] == ["a", "c", "b"]
    assert recs[2] == ok("b", "fixed")


def test_resume_success_beats_error_for_same_id(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "x", "error": {"line": 1, "message": "m"}}) + "\n"
                   + json.dumps(ok("x")) + "\n")
    with OutputWriter(out) as w:
        assert same(w.done_ids, {"x"}) and w.retried == 0
    assert read_records(out) == [ok("x")]


def test_partial_last_line_is_cut_off(tmp_path):
    out = tmp_path / "out.jsonl"
    good = json.dumps(ok("a")) + "\n" + json.dumps(ok("b")) + "\n"
    cut = json.dumps(ok("c", "x" * 50))[:40]
    out.write_bytes(good.encode() + cut.encode())
    with OutputWriter(out) as w:
        assert out.read_bytes() == good.encode()
        assert w.repaired_bytes == len(cut)
        assert same(w.done_ids, {"a", "b"})
        w.write(ok("c"))
    assert [r["id"] for r in read_records(out)] == ["a", "b", "c"]


def test_trailing_garbage_lines_are_cut_off(tmp_path):
    out = tmp_path / "out.jsonl"
    good = (json.dumps(ok("a")) + "\n").encode()
    out.write_bytes(good + b"\x00\x00\x00\n{\"id\": \"z\", \n")
    with OutputWriter(out) as w:
        assert same(w.done_ids, {"a"})
    assert out.read_bytes() == good


def test_complete_last_record_without_newline_is_kept(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(ok("a")) + "\n" + json.dumps(ok("b")))
    with OutputWriter(out) as w:
        assert same(w.done_ids, {"a", "b"}) and w.repaired_bytes == 0
        w.write(ok("c"))
    assert [r["id"] for r in read_records(out)] == ["a", "b", "c"]


def test_corrupt_middle_lines_are_kept_but_not_done(tmp_path):
    out = tmp_path / "out.jsonl"
    lines = [json.dumps(ok("a")), '{"id": "m", "compl', "", json.dumps(ok("b")),
             json.dumps({"id": "e", "error": {"line": 9, "message": "m"}})]
    out.write_text("\n".join(lines) + "\n")
    with OutputWriter(out) as w:  # the error record forces a rewrite: corrupt lines must survive it
        assert same(w.done_ids, {"a", "b"})
        assert w.corrupt_lines == 1
        assert w.write(ok("m")) is True
    assert out.read_text().splitlines() == lines[:4] + [json.dumps(ok("m"))]


def test_foreign_file_is_not_truncated(tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("my notes\nmore notes\n")
    with pytest.raises(JobFileError, match="--no-resume"):
        OutputWriter(out)
    assert out.read_text() == "my notes\nmore notes\n"
    with OutputWriter(out, resume=False):
        pass
    assert out.read_bytes() == b""


def test_no_resume_truncates(tmp_path):
    out = tmp_path / "out.jsonl"
    with OutputWriter(out) as w:
        w.write(ok("a"))
    with OutputWriter(out, resume=False) as w:
        assert same(w.done_ids, set())
        assert w.write(ok("a", "new")) is True
    assert read_records(out) == [ok("a", "new")]


def test_output_errors_are_one_line(tmp_path):
    with pytest.raises(JobFileError, match="is a directory"):
        OutputWriter(tmp_path)


@pytest.mark.skipif(output.fcntl is None, reason="no flock on this platform")
def test_second_writer_on_same_output_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    with OutputWriter(out) as w:
        w.write(ok("a"))
        with pytest.raises(JobFileError, match="in use"):
            OutputWriter(out)
    with OutputWriter(out) as w:  # lock released on close
        assert same(w.done_ids, {"a"})


CRASH_SCRIPT = textwrap.dedent("""
    import sys
    from klotski.io.output import OutputWriter
    w = OutputWriter(sys.argv[1])
    for i in range(int(sys.argv[2])):
        # Big records: SIGKILL can then land inside write() and leave half a line.
        if w.write({"id": f"r{i}", "completion": "x" * 1_000_000, "finish_reason": "length",
                    "prompt_tokens": 1, "completion_tokens": 1}):
            print(f"r{i}", flush=True)
""")


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_mid_run_then_resume_completes_exactly_once(tmp_path):
    out, total = tmp_path / "out.jsonl", 150
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    reported = set()  # ids whose write() had returned before the kill
    for _ in range(3):  # each run resumes the previous one's file, then dies too
        proc = subprocess.Popen([sys.executable, "-c", CRASH_SCRIPT, str(out), str(total)],
                                stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(5):
            line = proc.stdout.readline()
            assert line, "writer subprocess stopped early"
            reported.add(line.strip())
        time.sleep(0.02)  # it is writing more records now
        proc.send_signal(signal.SIGKILL)
        reported |= set(proc.stdout.read().split())
        proc.wait()
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL

    with OutputWriter(out) as w:
        assert all(rid in w.done_ids for rid in reported)
        assert len(w.done_ids) < total
        for i in range(total):
            w.write({"id": f"r{i}", "completion": "resumed"})
        assert w.duplicates == len(w.done_ids)

    raw = out.read_bytes()
    assert raw.endswith(b"\n")
    ids = [json.loads(line)["id"] for line in raw.decode("utf-8").splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(total))
