"""`smollm2-moe-distinct`'s construction (klotski/builtin/smollm.upcycle), on a small dense Llama
that transformers builds (the trained model's build takes minutes): the upcycled experts differ
by the stated perturbation and routing changes the text, while the engine stays token-identical
to transformers on the folder (exactness holds for any weights). Without the perturbation the
experts are the dense MLP's copies, as `smollm2-moe`'s are."""
import json

import pytest
import torch

from conftest import engine_tokens, reference_tokens
from klotski.builtin import smollm

NEW = 6


def dense_llama(tokenizer_dir):
    from transformers import LlamaConfig, LlamaForCausalLM
    c = json.loads((tokenizer_dir / "config.json").read_text())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=c["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         bos_token_id=c.get("bos_token_id"), eos_token_id=c.get("eos_token_id"),
                         pad_token_id=c.get("pad_token_id"))
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def upcycled(checkpoints, tmp_path_factory):
    from transformers import AutoTokenizer
    tokenizer_dir = checkpoints["gqa"]
    dense = dense_llama(tokenizer_dir)
    out = {}
    for name, perturbation in (("copies", 0.0), ("distinct", smollm.PERTURBED["smollm2-moe-distinct"])):
        moe = smollm.upcycle(dense, "float32", seed=0, perturbation=perturbation)
        folder = tmp_path_factory.mktemp(name)
        moe.save_pretrained(folder)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
        out[name] = (moe, folder)
    return dense, out


def test_the_distinct_experts_differ_by_the_perturbation_and_copies_do_not(upcycled):
    dense, out = upcycled
    ref = dense.model.layers[1].mlp.down_proj.weight
    copies = out["copies"][0].model.layers[1].mlp.experts.down_proj
    distinct = out["distinct"][0].model.layers[1].mlp.experts.down_proj
    assert all(torch.equal(copies[e], ref) for e in range(len(copies)))
    ratios = [(distinct[e] / ref - 1) for e in range(len(distinct))]
    for e, r in enumerate(ratios):
        assert abs(r.std().item() - smollm.PERTURBED["smollm2-moe-distinct"]) < 0.01, e
    assert not torch.equal(ratios[0], ratios[1])  # each expert its own draw


def logits(folder, top_k: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, num_experts_per_tok=top_k).eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 40)[None]).logits


def test_routing_matters_and_the_engine_stays_exact(upcycled):
    _, out = upcycled
    folder = out["distinct"][1]
    got, _ = engine_tokens(folder, max_new_tokens=NEW)
    assert got == reference_tokens(folder, max_new_tokens=NEW)
    # a token's second expert changes its output (its copies' twin: it changes nothing)
    assert not torch.allclose(logits(folder, 1), logits(folder, 2), rtol=0, atol=1e-5)
    assert torch.allclose(logits(out["copies"][1], 1), logits(out["copies"][1], 2), rtol=0, atol=1e-5)
