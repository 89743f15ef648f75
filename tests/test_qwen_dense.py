"""Qwen MoE configs with dense layers (`mlp_only_layers`, `decoder_sparse_step`), built with
transformers' own classes: greedy fp32 tokens identical to transformers with the defaults and
under a tight device budget; a dense layer has no experts and its MLP travels in its gate group."""
import pytest

from conftest import PROMPTS, engine_tokens, reference_tokens
from klotski.builtin.families import build_family

# 4 layers: 0 dense (mlp_only_layers), 1 MoE, 2 dense (step 2), 3 MoE; the dense MLP is wider
# than an expert so a layer read at the wrong width fails on its shape
DENSE = dict(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2, intermediate_size=160)


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe"])
def dense_model(request, tmp_path_factory):
    path = build_family(tmp_path_factory.mktemp(request.param) / "m", request.param, **DENSE)
    return request.param, path, reference_tokens(path)


def test_dense_layers_follow_transformers_rule(dense_model):
    from klotski.io.checkpoint import Checkpoint
    _, path, _ = dense_model
    spec = Checkpoint.open(path).spec
    assert [spec.shape.experts_in(j) for j in range(4)] == [0, spec.shape.num_experts, 0, spec.shape.num_experts]
    assert [spec.shape.moe_index(j) for j in (1, 3)] == [0, 1]  # predictors count MoE layers only
    gate0, gate1 = spec.group_refs(("gate", 0)), spec.group_refs(("gate", 1))
    assert {"dense_w1", "dense_w2", "dense_w3"} <= set(gate0) and "router" not in gate0
    assert "router" in gate1 and "dense_w1" not in gate1
    assert gate0["dense_w1"].name == "model.layers.0.mlp.gate_proj.weight"
    assert ("expert", 2, 0) not in spec.group_keys() and ("expert", 3, 0) in spec.group_keys()


def test_greedy_equals_transformers_default_budget(dense_model):
    family, path, ref = dense_model
    ours, engine = engine_tokens(path, batch_size=len(PROMPTS))
    assert engine.spec.shape.model_type == family
    assert ours == ref
    assert sum(len(set(t)) for t in ours) > 2 * len(PROMPTS)  # real, varied generations


@pytest.mark.parametrize("schedule, n", [("klotski", 2), ("multibatch", 1)])
def test_greedy_equals_transformers_tight_budget(dense_model, schedule, n):
    _, path, ref = dense_model
    _, probe = engine_tokens(path, prompts=["x"], max_new_tokens=1)
    quarter = sum(probe.cache.full.values()) // 4
    ours, engine = engine_tokens(path, device_memory=quarter, batch_size=3, num_batches=n, schedule=schedule)
    assert ours == ref
    assert engine.memory.peak <= quarter
    assert engine.pipeline.experts_loaded > 0  # experts really moved


def test_bad_dense_fields_are_refused_in_one_line(dense_model, tmp_path):
    import json
    import shutil

    from klotski.io.checkpoint import Checkpoint
    from placement.store import CheckpointError
    _, path, _ = dense_model
    for change, expected in (({"mlp_only_layers": [9]}, r"field 'mlp_only_layers' is \[9\]; must be a list of layer"),
                             ({"decoder_sparse_step": 0}, r"field 'decoder_sparse_step' is 0"),
                             ({"mlp_only_layers": [0, 1]}, r"model\.layers\.1\.mlp\.gate_proj\.weight")):
        broken = tmp_path / "broken"
        shutil.rmtree(broken, ignore_errors=True)
        shutil.copytree(path, broken)
        cfg = json.loads((broken / "config.json").read_text())
        (broken / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(CheckpointError, match=expected) as e:
            Checkpoint.open(broken)
        assert "\n" not in str(e.value)
