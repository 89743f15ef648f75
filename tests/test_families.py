"""Every supported family against transformers' own classes: greedy fp32 tokens identical
with the defaults and, for every schedule and n in {1, 4}, under a device budget of a
quarter of the model; a checkpoint that does not match its config is refused."""
import json

import pytest

from conftest import PROMPTS, engine_tokens, reference_tokens
from klotski.builtin.families import FAMILIES, build_family


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: build_family(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def family_refs(family_models):
    return {f: reference_tokens(path) for f, path in family_models.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers(family_models, family_refs, family):
    ours, engine = engine_tokens(family_models[family], batch_size=len(PROMPTS))
    assert engine.spec.model_type == family
    assert ours == family_refs[family]
    assert sum(len(set(t)) for t in ours) > 2 * len(PROMPTS)  # real, varied generations


@pytest.mark.parametrize("schedule", ["klotski", "hot-prefetch", "multibatch", "simple"])
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_quarter_budget_every_schedule(family_models, family_refs, family, schedule, n):
    if schedule == "simple" and n > 1:
        pytest.skip("simple runs one batch")
    _, probe = engine_tokens(family_models[family], prompts=["x"], max_new_tokens=1)
    quarter = sum(probe.cache.full.values()) // 4
    ours, engine = engine_tokens(family_models[family], device_memory=quarter,
                                 batch_size=max(1, 6 // n), num_batches=n, schedule=schedule)
    assert ours == family_refs[family]
    assert engine.memory.peak <= quarter
    assert engine.pipeline.experts_loaded > 0  # experts really moved


def _copy_with_config(src, dst, **changes):
    import shutil
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("family, changes, expected", [
    ("qwen3_moe", {"moe_intermediate_size": 64}, r"tensor model\.layers\.0\.mlp\.experts\.0\.\w+_proj\.weight has shape"),
    ("qwen3_moe", {"head_dim": 16}, r"tensor model\.layers\.0\.self_attn\.(q_proj|q_norm)\.weight has shape"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 48}, r"mlp\.shared_expert\.\w+_proj\.weight has shape"),
    ("olmoe", {"attention_bias": True}, r"model\.layers\.0\.self_attn\.q_proj\.bias"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, r"config\.json: field 'use_sliding_window'"),
    ("qwen2_moe", {"mlp_only_layers": [1]}, r"config\.json: fields 'mlp_only_layers' \[1\].*not supported"),
    ("olmoe", {"clip_qkv": -1}, r"config\.json: field 'clip_qkv' is -1"),
    ("qwen3_moe", {"model_type": "phimoe"}, r"field 'model_type' is 'phimoe'; supported: mixtral, qwen3_moe"),
])
def test_a_checkpoint_that_disagrees_with_its_config_is_refused_naming_what(family_models, tmp_path, family,
                                                                            changes, expected):
    from klotski.io.checkpoint import Checkpoint
    from placement.store import CheckpointError
    broken = _copy_with_config(family_models[family], tmp_path / "broken", **changes)
    with pytest.raises(CheckpointError, match=expected) as e:
        Checkpoint.open(broken)
    assert "\n" not in str(e.value)



@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_hqq4_packs_each_familys_projections_and_keeps_the_rest(family_models, tmp_path, family):
    """--quantize hqq4 by group-local names: q/k/v/o and the routed experts are packed, biases,
    q/k norms, the router and the shared expert stay in dtype; tokens do not depend on where
    the packed bytes live."""
    from klotski.compress.hqq import load_quantized
    resident, engine = engine_tokens(family_models[family], quantize="hqq4", offload_dir=str(tmp_path / "q"),
                                     batch_size=6, num_batches=1)
    copy = tmp_path / "q"
    attn = load_quantized(copy, "attn.0")
    assert {"q.header", "o.header"} <= set(attn) and "q" not in attn
    kept = {"q_norm", "k_norm"} if family == "olmoe" else {"q_bias", "k_bias", "v_bias"}
    assert kept <= set(attn)
    with pytest.raises(KeyError):  # router and shared expert are read from the checkpoint as they are
        load_quantized(copy, "gate.0")
    quarter = sum(engine.cache.full.values()) // 4
    moved, engine = engine_tokens(family_models[family], quantize="hqq4", offload_dir=str(tmp_path / "q"),
                                  device_memory=quarter, batch_size=2, num_batches=3)
    assert moved == resident
    assert engine.pipeline.experts_loaded > 0
