"""gpt-oss against transformers' own GptOssForCausalLM: stored in bf16 and in the MXFP4 layout
OpenAI publishes (experts kept packed on every tier, decoded on the device), greedy fp32
tokens identical with the defaults and, for every schedule, under a quarter-of-the-model
device budget. The unquantized fp32 form runs in tests/test_families.py with the others."""
import json
import shutil

import pytest
import torch

from conftest import PROMPTS, engine_tokens, reference_tokens, reference_tokens_of
from klotski.builtin.families import build_family, pack_mxfp4

# A harmony-like template, as gpt-oss checkpoints ship one in chat_template.jinja
HARMONY = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
           "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    fp32 = build_family(root / "fp32", "gpt_oss")
    return {"fp32": fp32, "bf16": build_family(root / "bf16", "gpt_oss", dtype="bfloat16"),
            "mxfp4": pack_mxfp4(fp32, root / "mxfp4")}


@pytest.fixture(scope="module")
def refs(models):
    return {name: reference_tokens(path) for name, path in models.items() if name != "fp32"}


def test_the_window_and_the_packing_change_the_output(models, refs, tmp_path):
    """The prompts outgrow the 4-token window of the sliding layers, and the MXFP4 model is
    not the fp32 one: a test passing on both could not pass by ignoring either."""
    wide = shutil.copytree(models["mxfp4"], tmp_path / "wide")
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "sliding_window": 1024}))
    assert reference_tokens(wide) != refs["mxfp4"]
    assert reference_tokens(models["fp32"]) != refs["mxfp4"]


def test_mxfp4_experts_decode_to_what_transformers_loads(models):
    """Every expert of every layer decodes bit for bit to transformers' dequantized weights."""
    from transformers import AutoModelForCausalLM

    from klotski.io.checkpoint import Checkpoint
    from klotski.compress.mxfp4 import Mxfp4Codec
    ckpt = Checkpoint.open(str(models["mxfp4"]))
    codec = Mxfp4Codec(ckpt.store, ckpt.spec, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(models["mxfp4"], dtype=torch.float32)
    for j, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for e in range(ckpt.spec.shape.num_experts):
            parts = codec.read(("expert", j, e))
            assert parts["gate_up_blocks"].dtype == torch.uint8  # read packed
            w = codec.decode(parts)
            assert torch.equal(w["gate_up"], experts.gate_up_proj[e].detach())
            assert torch.equal(w["down"], experts.down_proj[e].detach())
            assert torch.equal(w["down_bias"], experts.down_proj_bias[e].detach())
    ckpt.close()


@pytest.mark.parametrize("form", ["bf16", "mxfp4"])
def test_greedy_equals_transformers(models, refs, form):
    ours, engine = engine_tokens(models[form], batch_size=len(PROMPTS))
    assert ours == refs[form]
    assert sum(len(set(t)) for t in ours) > 2 * len(PROMPTS)


@pytest.fixture(scope="module")
def quarter(models):
    _, probe = engine_tokens(models["mxfp4"], prompts=["x"], max_new_tokens=1)
    return sum(probe.cache.full.values()) // 4


@pytest.mark.parametrize("schedule, n", [("klotski", 3), ("hot-prefetch", 3), ("multibatch", 3), ("simple", 1)])
def test_mxfp4_quarter_budget_every_schedule(models, refs, quarter, schedule, n):
    """A quarter of the model in the compute dtype, as for every family (a quarter of the
    packed bytes cannot hold this tiny model's fp32 head and decoded experts): experts come
    and go as blocks and scales, decoded per use, and the tokens do not change."""
    ours, engine = engine_tokens(models["mxfp4"], device_memory=quarter, batch_size=max(1, 6 // n),
                                 num_batches=n, schedule=schedule)
    assert ours == refs["mxfp4"]
    assert engine.memory.peak <= quarter
    assert engine.pipeline.experts_loaded > 0


def test_bf16_stored_quarter_budget(models, refs):
    _, probe = engine_tokens(models["bf16"], prompts=["x"], max_new_tokens=1)
    quarter = sum(probe.cache.full.values()) // 4
    ours, engine = engine_tokens(models["bf16"], device_memory=quarter, batch_size=2, num_batches=3)
    assert ours == refs["bf16"] and engine.pipeline.experts_loaded > 0


def test_mxfp4_bytes_are_counted_packed(models):
    """Planner, cache and links see the packed expert: blocks + scales as stored, biases in the
    compute dtype; the decoded copy is what the device expands it into per use."""
    from klotski.io.checkpoint import Checkpoint
    mx, full = Checkpoint.open(str(models["mxfp4"])), Checkpoint.open(str(models["fp32"]))
    spec = mx.spec
    H, I = spec.shape.hidden_size, spec.shape.intermediate_size
    packed = 3 * H * I // 2 + 3 * H * I // 32 + (2 * I + H) * 4
    assert mx.group_nbytes(("expert", 1, 5), torch.float32) == (packed, (3 * H * I + 2 * I + H) * 4)
    sizes, plain = mx.group_bytes(torch.float32), full.group_bytes(torch.float32)
    assert sizes.expert == packed and sizes.expert_decoded == plain.expert
    assert sizes.attention == plain.attention and sizes.gate == plain.gate
    mx.close(), full.close()


def test_chat_messages_use_the_checkpoints_template(models, tmp_path):
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.io.requests import Request
    chat = shutil.copytree(models["mxfp4"], tmp_path / "chat")
    (chat / "chat_template.jinja").write_text(HARMONY)
    cfg = json.loads((chat / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)  # the .jinja file is the template, as in the published checkpoints
    (chat / "tokenizer_config.json").write_text(json.dumps(cfg))
    req = Request(id="c", line=1, prompt=None, messages=(("user", "Tell me about Paris"),), max_new_tokens=6)
    engine, seqs, errors = open_engine(RunConfig(model=str(chat), progress=False, dtype="float32"), [req])
    assert not errors
    ids = seqs[0].prompt_ids
    text = engine.tokenizer.decode(ids)
    assert text.startswith("<|start|>user<|message|>Tell me about Paris<|end|>") and text.endswith("assistant")
    done = list(engine.run(seqs))
    engine.close()
    assert done[0].out == reference_tokens_of(chat, [ids], max_new_tokens=6)[0]


@pytest.mark.parametrize("change, expected", [
    ({"layer_types": ["full_attention"]}, r"field 'layer_types' is \['full_attention'\]; must be a list of 3"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}},
     r"quant_method 'bitsandbytes'\); Klotski reads unquantized bf16/fp16/fp32 weights or mxfp4 as published"),
    ({"swiglu_limit": 0}, r"field 'swiglu_limit' is 0; must be a finite number greater than 0"),
])
def test_a_bad_config_is_refused_in_one_line(models, tmp_path, change, expected):
    from klotski.io.checkpoint import Checkpoint
    from placement.store import CheckpointError
    bad = shutil.copytree(models["mxfp4"], tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(CheckpointError, match=expected) as e:
        Checkpoint.open(str(bad))
    assert "\n" not in str(e.value)


def test_hqq_on_an_mxfp4_checkpoint_is_refused(models):
    from klotski.config import ConfigError
    with pytest.raises(ConfigError, match="ships its experts in MXFP4 already"):
        engine_tokens(models["mxfp4"], prompts=["x"], max_new_tokens=1, quantize="hqq4")


def test_builtin_shapes_plan_without_weights(capsys):
    """`klotski plan --model gpt-oss-120b` answers from the built-in shape, which is the one
    transformers' GptOssConfig defaults (the 120b) and MXFP4 experts give: 13 MB an expert."""
    from transformers import GptOssConfig

    from klotski.cli import main as cli
    from planner.shapes import KNOWN_MODELS, ModelShape
    cfg = {**GptOssConfig().to_dict(), "dtype": "bfloat16", "quantization_config": {"quant_method": "mxfp4"}}
    assert ModelShape.from_config(cfg, name="gpt-oss-120b") == KNOWN_MODELS["gpt-oss-120b"]
    assert 13.0e6 < KNOWN_MODELS["gpt-oss-120b"].expert_nbytes() < 13.3e6
    assert cli.main(["plan", "--model", "gpt-oss-120b", "--hardware", "rtx3090-pcie4", "--host-memory", "64GiB",
                     "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["predicted_tokens_per_s"] > 0
    assert cli.main(["plan", "--model", "gpt-oss-20b", "--hardware", "rtx3090-pcie4"]) == 0
    assert "predicted" in capsys.readouterr().out


@pytest.mark.parametrize("name, total, active", [("gpt-oss-120b", 116.83e9, 5.13e9), ("gpt-oss-20b", 20.91e9, 3.61e9)])
def test_builtin_shapes_have_the_published_parameter_counts(name, total, active):
    """Total and active parameters as OpenAI's model card counts them (active: top-4 experts and
    the unembedding, not the embedding), within 1%: a wrong width, count or bias would miss."""
    from planner.shapes import KNOWN_MODELS, total_params
    s = KNOWN_MODELS[name]
    used = s.num_layers * (s.attention_params + s.gate_params + s.top_k * (s.expert_params + s.expert_bias_params)) \
        + s.vocab_size * s.hidden_size
    assert total_params(s) == pytest.approx(total, rel=0.01)
    assert used == pytest.approx(active, rel=0.01)
