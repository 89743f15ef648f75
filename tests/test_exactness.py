"""Greedy output equals transformers' token for token; hidden states match per layer."""
import pytest
import torch

from conftest import PROMPTS, VARIANTS, engine_tokens, reference_tokens
from klotski.config import RunConfig
from klotski.assemble import open_engine
from klotski.schedule.sequences import prefill_input


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_equals_transformers(checkpoints, variant):
    ref = reference_tokens(checkpoints[variant])
    ours, _ = engine_tokens(checkpoints[variant], batch_size=len(PROMPTS))  # uneven prompts, one batch
    assert ours == ref
    assert sum(map(len, ours)) > len(PROMPTS)  # real generations, not immediate EOS


@pytest.mark.parametrize("variant", ["gqa", "window"])
def test_hidden_states_match_per_layer(checkpoints, variant):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = checkpoints[variant]
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    enc = tok(PROMPTS[:3], return_tensors="pt", padding=True)
    with torch.no_grad():
        position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        ref = model(**enc, position_ids=position_ids, output_hidden_states=True).hidden_states

    engine, seqs, _ = open_engine(RunConfig(model=str(path), progress=False, dtype="float32", batch_size=3),
                                  __import__("conftest").requests(PROMPTS[:3]))
    ours = {}
    engine.pipeline.on_layer = lambda layer, hs: ours.__setitem__(layer, hs[0].clone())
    from klotski.execute.kvcache import BatchKV
    batch = sorted(seqs, key=lambda s: PROMPTS.index(s.request.prompt))
    length = max(len(s.prompt_ids) for s in batch)
    kv = BatchKV(engine.spec.shape.num_layers, 3, engine.spec.shape.num_kv_heads, engine.spec.shape.head_dim, length, torch.float32)
    inp = prefill_input(batch, length, 0)
    assert torch.equal(inp.ids[inp.valid], enc["input_ids"][enc["attention_mask"].bool()])
    engine.pipeline.forward([kv], [inp])
    mask = enc["attention_mask"].bool()
    for layer in range(engine.spec.shape.num_layers - 1):  # transformers' last entry is after the final norm
        torch.testing.assert_close(ours[layer][mask], ref[layer + 1][mask], atol=1e-5, rtol=1e-5)


def test_hub_and_fused_expert_layouts_agree(checkpoints):
    hub, _ = engine_tokens(checkpoints["gqa"])
    fused, engine = engine_tokens(checkpoints["fused"])
    assert engine.spec.fused_experts
    assert hub == fused == reference_tokens(checkpoints["fused"])


def test_a_single_swapped_expert_is_caught(checkpoints, monkeypatch):
    """The comparison is sensitive: swapping two experts of one layer changes the tokens."""
    from klotski.models.spec import ModelSpec
    original = ModelSpec.expert_refs

    def swapped(self, layer, expert):
        if layer == 1 and expert in (2, 5):
            expert = 7 - expert
        return original(self, layer, expert)

    monkeypatch.setattr(ModelSpec, "expert_refs", swapped)
    ours, _ = engine_tokens(checkpoints["gqa"])
    assert ours != reference_tokens(checkpoints["gqa"])
