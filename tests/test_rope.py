"""Scaled RoPE (linear, llama3, yarn): frequencies from transformers' own RoPE utilities, so a
checkpoint that declares one runs exactly as transformers runs it; types whose frequencies
change with the sequence length are refused in one line, as are missing required fields."""
import json

import pytest
import torch

from conftest import reference_tokens
from klotski.cli import main as cli
from klotski.builtin import tiny
from klotski.models import layers as M
from klotski.models.spec import ModelSpec

SCALED = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
}


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope")
    return {name: tiny.build_checkpoint(root / name, "tiny", rope_parameters=dict(params))
            for name, params in SCALED.items()}


@pytest.mark.parametrize("kind", SCALED)
def test_rope_tables_equal_transformers_rotary_embedding(kind, scaled):
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralRotaryEmbedding
    spec = ModelSpec.from_dir(scaled[kind])
    rotary = MixtralRotaryEmbedding(AutoConfig.from_pretrained(scaled[kind]))
    positions = torch.arange(300)[None]
    ours = M.rope_tables(positions, spec.rope_inv_freq, spec.rope_attention_scaling, torch.float32)
    theirs = rotary(torch.zeros(1, dtype=torch.float32), positions)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    plain = M.rope_tables(positions, ModelSpec.from_dir(tiny.ensure_builtin("tiny-mixtral")).rope_inv_freq, 1.0,
                          torch.float32)
    assert not torch.equal(ours[0], plain[0])  # the scaling is really applied


@pytest.mark.parametrize("kind", SCALED)
def test_scaled_rope_generates_transformers_tokens(kind, scaled, tmp_path):
    from conftest import PROMPTS
    from test_cli import read_lines, run
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    out = tmp_path / "out.jsonl"
    r = run(["generate", str(jobs), "--model", str(scaled[kind]), "-o", str(out), "--max-new-tokens", "10",
             "--dtype", "float32", "--include-token-ids", "--no-progress"])
    assert r.returncode == 0, r.stderr
    got = {rec["id"]: rec["token_ids"] for rec in read_lines(out)}
    want = reference_tokens(scaled[kind], PROMPTS, 10)
    assert [got[f"q{i}"] for i in range(len(PROMPTS))] == want


@pytest.mark.parametrize("params, words", [
    ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, "'rope_parameters.rope_type' is 'dynamic'"),
    ({"rope_type": "yarn", "rope_theta": 10000.0}, "'factor'"),
    ({"rope_type": "linear", "rope_theta": 10000.0, "factor": -2.0}, "'rope_parameters.factor' is -2.0"),
])
def test_unusable_rope_parameters_are_refused_in_one_line(params, words, tmp_path, capsys):
    model = tiny.build_checkpoint(tmp_path / "m", "tiny")
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_parameters"] = params
    (model / "config.json").write_text(json.dumps(cfg))
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"id": "a", "prompt": "Hello"}\n')
    assert cli.main(["generate", str(jobs), "--model", str(model), "-o", str(tmp_path / "o.jsonl"),
                     "--no-progress"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and "config.json" in err[0], err
