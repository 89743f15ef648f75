"""Runs teach the planner where answers stop (planner/answer_lengths.py; klotski/planning.py:
plan_job, learn_from_run): a plan before any run prices each answer at its max_tokens; after a
quiet run whose answers stop early, the next plan of the same job prices the lengths the run
generated (counted here from the run's own records); a busy run teaches nothing; a damaged
file is ignored with one line."""
from __future__ import annotations

import json

import pytest
import torch

from klotski import planning
from klotski.learning import learn_from_run
from klotski.cli import main as cli
from planner import answer_lengths, calibrate
from planner.profile import Profile


def _jobs(path, n=6, cap=12):
    """Lines that stop early: half the vocabulary ends an answer (the tiny model's greedy
    tokens, random weights, hit one of them after a few tokens or none at all)."""
    stops = list(range(0, 512, 2))
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"q{i}", "prompt": f"question {i} " + "word " * (3 + i),
                                "max_new_tokens": cap, "stop_token_ids": stops}) + "\n")
    return path


@pytest.fixture
def learning(checkpoints, tmp_path, monkeypatch):
    """generate with its learning on, the lengths in a file of this test's own, a synthetic
    profile left as it is (its terms are tests/test_profile_learning.py's), the machine quiet or
    busy as the test says."""
    path = tmp_path / "lengths.json"
    monkeypatch.setattr(planning, "answer_lengths_path", lambda ckpt: path)
    monkeypatch.setattr("klotski.generate.learn_from_run", learn_from_run)
    monkeypatch.setattr(calibrate, "correct", lambda profile, *a, **kw: {**calibrate.section(profile),
                                                                         "corrected": False, "why": "not here"})
    machine = {"busy": None}
    monkeypatch.setattr("klotski.util.threads.machine_busy", lambda: machine["busy"])
    # a profile of round numbers: nothing measured (the lengths, not the speeds, are under test)
    monkeypatch.setattr(planning, "profile_for", lambda *a, **kw: Profile(
        name="synthetic", flops=2e10, mem_bw=1e10, links={"host_to_device": 5e9, "disk_to_host": 1e9,
                                                          "device_to_host": 5e9}))
    jobs = _jobs(tmp_path / "jobs.jsonl")

    def run(k: int) -> dict:
        report = tmp_path / f"r{k}.json"
        out = tmp_path / f"out{k}.jsonl"
        assert cli.main(["generate", str(jobs), "--model", str(checkpoints["gqa"]), "-o", str(out), "--no-resume",
                         "--no-progress", "--threads", str(torch.get_num_threads()), "--report", str(report)]) == 0
        r = json.loads(report.read_text())
        r["answer_tokens"] = sum(rec["completion_tokens"] for rec in map(json.loads, out.read_text().splitlines()))
        return r
    monkeypatch.setattr(planning, "measure_here", lambda *a, **kw: planning.profile_for("auto", None))
    return type("Learning", (), {"path": path, "run": staticmethod(run), "machine": machine,
                                 "model": str(checkpoints["gqa"])})


def test_a_quiet_run_teaches_the_next_plan_its_answer_lengths(learning, capsys):
    first = learning.run(1)
    planned = first["plan"]["answer_lengths"]
    assert planned["answer_tokens"] == planned["max_tokens"] == 6 * 12 and planned["runs"] == 0
    assert "assumed max_tokens" in planned["source"]
    generated = first["answer_tokens"]  # the records' own count
    assert generated < 6 * 12  # the answers stopped early: the test means something
    assert first["profile"]["answer_lengths"]["learned"]
    second = learning.run(2)
    planned = second["plan"]["answer_lengths"]
    # the next plan's decode tokens are the ones the run generated, not max_tokens
    assert planned["answer_tokens"] == generated == second["answer_tokens"]
    assert planned["source"] == "learned from 1 run of this job"
    # and its time is priced at them: the same profile, the decode a fraction of the first plan's
    assert second["predicted_decode_s"] < first["predicted_decode_s"] * (generated / 72 + 0.25)
    assert "answers   planned at" in capsys.readouterr().err
    # `klotski profile --show` says what was learned
    assert cli.main(["profile", "--model", learning.model, "--show"]) == 0
    shown = capsys.readouterr().out
    assert "answers   1 job learned" in shown and f"6 answers, mean {generated / 6:.1f} tokens, from 2 runs" in shown


def test_a_busy_run_teaches_nothing(learning):
    learning.machine["busy"] = 3.0
    r = learning.run(1)
    assert not r["profile"]["answer_lengths"]["learned"] and "busy" in r["profile"]["answer_lengths"]["why"]
    assert not learning.path.exists()  # the next plan takes max_tokens


def test_a_damaged_file_is_ignored_with_one_line(tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text('{"version": 1, "jobs": {"k": {"lengths": [3, ')
    said = []
    data = answer_lengths.read(path, warn=said.append)
    assert data == {} and len(said) == 1 and str(path) in said[0] and "max_tokens" in said[0]
    lens, source = answer_lengths.lengths_for(data, "k", [8, 8])
    assert lens == [8, 8] and source["runs"] == 0 and "max_tokens" in source["source"]
    said.clear()  # whole JSON, wrong inside: the same
    path.write_text('{"version": 1, "jobs": {"k": {"lengths": ["x"], "runs": 1}}, "recent": []}')
    assert answer_lengths.read(path, warn=said.append) == {} and len(said) == 1
    # the next quiet run writes it afresh
    answer_lengths.record(path, "k", [2, 5], [2, 5], [8, 8], warn=said.append)
    assert answer_lengths.lengths_for(answer_lengths.read(path), "k", [8, 8])[0] == [2, 5]


def test_the_model_s_recent_runs_price_a_job_not_seen_yet():
    """Another job of the same model: each answer at the runs' shares of its cap, spread as
    they had them (half at a tenth of the cap, half at the cap: the mean is kept)."""
    data = answer_lengths.learned({}, "a", [1] * 10 + [10] * 10, [1] * 10 + [10] * 10, [10] * 20)
    lens, source = answer_lengths.lengths_for(data, "b", [40] * 200)
    assert "recent run" in source["source"]
    assert sum(lens) / len(lens) == pytest.approx(22, rel=0.1)  # (4 + 40) / 2
    # a job seen twice: the mean of its runs, the newest weighing more as runs accumulate
    data = answer_lengths.learned(data, "a", [3] * 20, [3] * 20, [10] * 20)
    assert answer_lengths.lengths_for(data, "a", [10] * 20)[0][:2] == [2, 2]  # (1 + 3) / 2


def test_runs_ending_at_once_each_add_their_lesson(tmp_path):
    """Two writers (two runs' processes, a server's batch beside a generate) adding runs at once:
    under the lock every run is counted and the file stays whole."""
    import threading
    path = tmp_path / "lengths.json"

    def runs():
        for _ in range(15):
            answer_lengths.record(path, "k", [2, 5], [2, 5], [8, 8])
    writers = [threading.Thread(target=runs) for _ in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    data = answer_lengths.read(path)
    assert data["jobs"]["k"]["runs"] == 45 and len(data["recent"]) == answer_lengths.RECENT
