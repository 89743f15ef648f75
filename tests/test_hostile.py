"""Hostile checkpoints: each broken copy (tests/hostile.py) is refused in one line naming what
is wrong, before any output exists, or -- for non-finite numbers -- gets error records for
the prompts it cannot compute while the others carry on. `klotski check` finds each."""
import json
import shutil

import pytest

import hostile
from conftest import PROMPTS, requests
from klotski.cli import main as cli
from klotski.builtin import tiny
from klotski.assemble import open_engine
from klotski.config import RunConfig


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return tiny.build_checkpoint(tmp_path_factory.mktemp("good") / "ckpt", "tiny")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    path = tmp_path_factory.mktemp("job") / "job.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


def _generate(job, model, out, capsys):
    rc = cli.main(["generate", str(job), "--model", str(model), "-o", str(out), "--max-new-tokens", "6",
                   "--no-progress"])
    return rc, capsys.readouterr().err


REFUSED = [k for k, (_, (what, _)) in hostile.KINDS.items() if what == "refused"]
RECORDS = [k for k, (_, (what, _)) in hostile.KINDS.items() if what == "records"]


def test_the_generator_breaks_what_it_says(good, tmp_path):
    """Guard against a mutation that silently does nothing."""
    assert len(REFUSED) >= 10 and len(RECORDS) >= 2
    d = hostile.broken_copy(good, tmp_path / "x", "nan expert")
    assert hostile.tensor_has_non_finite(d, hostile.EXPERT)
    assert not hostile.tensor_has_non_finite(good, hostile.EXPERT)


@pytest.mark.parametrize("kind", REFUSED)
def test_broken_checkpoint_is_refused_in_one_line_before_output(kind, good, job, tmp_path, capsys):
    model = hostile.broken_copy(good, tmp_path / "model", kind)
    out = tmp_path / "out.jsonl"
    rc, err = _generate(job, model, out, capsys)
    words = hostile.KINDS[kind][1][1]
    lines = err.strip().splitlines()
    assert rc == cli.EXIT_USAGE, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert words in lines[0] and str(model) in lines[0], lines[0]
    assert not out.exists(), "a refused run must not create the output file"
    # klotski check names the same problem
    assert cli.main(["check", "--model", str(model), "--no-progress"]) == 1
    assert words in capsys.readouterr().out


@pytest.mark.parametrize("kind", RECORDS)
def test_non_finite_numbers_become_error_records(kind, good, job, tmp_path, capsys):
    model = hostile.broken_copy(good, tmp_path / "model", kind)
    out = tmp_path / "out.jsonl"
    rc, err = _generate(job, model, out, capsys)
    assert "Traceback" not in err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(f"p{i}" for i in range(len(PROMPTS)))  # none lost
    errors = [r for r in records if "error" in r]
    assert errors and rc == 1
    for r in errors:
        assert r["error"]["message"].startswith("non-finite values " + hostile.KINDS[kind][1][1])
        assert "may be corrupt" in r["error"]["message"]
    assert f"{len(errors)} failed" in err
    assert cli.main(["check", "--model", str(model), "--no-progress"]) == 1
    assert "NaN and" in capsys.readouterr().out


def _run(model, prompts):
    engine, seqs, _ = open_engine(RunConfig(model=str(model), dtype="float32", batch_size=len(prompts),
                                            num_batches=1, progress=False), requests(prompts, max_new_tokens=8))
    try:
        return {s.request.prompt: s for s in engine.run(seqs)}, engine
    finally:
        engine.close()


def test_one_poisoned_prompt_fails_alone_and_the_others_are_unchanged(good, tmp_path):
    """NaN in the embedding row of a token only one prompt uses: that prompt gets an error naming
    layer 0; every other prompt of the same batch gives exactly the tokens of a clean run."""
    clean, engine = _run(good, PROMPTS)
    ids = {p: set(s.prompt_ids) for p, s in clean.items()}
    victim, token = next((p, t) for p in PROMPTS for t in sorted(ids[p])
                         if not any(t in ids[q] for q in PROMPTS if q != p))
    model = tmp_path / "model"
    shutil.copytree(good, model)
    hostile.poison_row(model, "model.embed_tokens.weight", token)
    poisoned, _ = _run(model, PROMPTS)
    assert poisoned[victim].error.startswith(f"non-finite values at layer 0 of {engine.spec.shape.num_layers}")
    for p in PROMPTS:
        if p != victim:
            assert poisoned[p].error is None
            assert poisoned[p].out == clean[p].out, p


def test_check_passes_a_good_checkpoint_reading_in_bounded_pieces(good, capsys, monkeypatch):
    from placement.store import TensorStore
    largest, real = [0], TensorStore.read_flat

    def spy(self, name, start, count):
        out = real(self, name, start, count)
        largest[0] = max(largest[0], out.numel() * out.element_size())
        return out
    monkeypatch.setattr(TensorStore, "read_flat", spy)
    assert cli.main(["check", "--model", str(good), "--host-memory", "64KiB", "--no-progress"]) == 0
    assert "0 problems" in capsys.readouterr().out
    assert 0 < largest[0] <= 16 << 10  # a quarter of the budget, though tensors are bigger


def test_a_prompt_using_a_token_beyond_the_vocabulary_fails_alone(good, tmp_path, capsys):
    """A tokenizer with more tokens than embedding rows (a few added special tokens, or another
    model's tokenizer): the prompts that use them become error records, the others run, and
    run right: their tokens are transformers' greedy fp32 ones on the good checkpoint."""
    from conftest import reference_tokens
    model = tmp_path / "model"
    shutil.copytree(good, model)
    hostile.add_tokens(3)(model)
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"id": "a", "prompt": "Paris <extra_1>"}\n{"id": "b", "prompt": "Paris"}\n')
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", str(jobs), "--model", str(model), "-o", str(out), "--no-progress", "--dtype",
                     "float32", "--max-new-tokens", "8", "--include-token-ids"]) == 1
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "outside the model's vocabulary (vocab_size 512" in records["a"]["error"]["message"]
    (expected,) = reference_tokens(good, ["Paris"], max_new_tokens=8)
    assert expected and records["b"]["token_ids"] == expected
    assert records["b"]["completion_tokens"] == len(expected)
    capsys.readouterr()
    assert cli.main(["check", "--model", str(model), "--no-progress"]) == 1
    assert "the tokenizer has 515 tokens" in capsys.readouterr().out
