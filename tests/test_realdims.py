"""klotski/builtin/realdims.py: checkpoints with real MoE layer shapes (shrunk here), checked
against transformers itself: it loads them with no missing or unexpected tensor, their widths
are the published configs' divided by the shrink, a forward pass in bfloat16 stays finite,
and skewed routing concentrates the router's choices where uniform does not."""
import pytest
import torch

from klotski.builtin import realdims

# the published config.json fields (hub), for the test to divide itself
PUBLISHED = {"mixtral-8x7b": dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, top_k=2,
                                  vocab_size=32000, heads=32, kv_heads=8, head_dim=128),
             "qwen3-30b-a3b": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, top_k=8,
                                   vocab_size=151936, heads=32, kv_heads=4, head_dim=128)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("realdims")
    return {(name, routing): realdims.build(root / f"{name}-{routing}", name, 2, shrink=16, routing=routing)
            for name in PUBLISHED for routing in ("skewed", "uniform")}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_transformers_loads_it_at_the_published_widths_over_16(built, name):
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(built[(name, "skewed")], dtype=torch.bfloat16,
                                                       output_loading_info=True)
    assert not any(info.values()), info
    cfg, pub = model.config, PUBLISHED[name]
    assert cfg.hidden_size == pub["hidden_size"] // 16 and cfg.num_hidden_layers == 2
    inter = cfg.moe_intermediate_size if name.startswith("qwen3") else cfg.intermediate_size
    assert inter == pub.get("moe_intermediate_size", pub.get("intermediate_size")) // 16
    experts = cfg.num_experts if name.startswith("qwen3") else cfg.num_local_experts
    assert experts == pub.get("num_experts", pub.get("num_local_experts")) and cfg.num_experts_per_tok == pub["top_k"]
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == \
        (pub["heads"] // 4, pub["kv_heads"] // 4, pub["head_dim"] // 4)
    assert cfg.vocab_size == pub["vocab_size"] // 16
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all() and logits.float().std() > 0.1


def test_a_second_build_is_the_first(built, tmp_path):
    path = built[("mixtral-8x7b", "skewed")]
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert realdims.build(path, "mixtral-8x7b", 2, shrink=16) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before  # the stamp matched: not rebuilt


def _top_expert_share(path) -> float:
    """Share of layer-0 token-slots the most chosen expert takes, by the checkpoint's own router."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    picks = []
    hook = model.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, o: picks.append(i[0]))
    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
    hook.remove()
    logits = picks[0].reshape(-1, picks[0].shape[-1]) @ model.model.layers[0].mlp.gate.weight.T
    chosen = logits.topk(model.config.num_experts_per_tok, dim=-1).indices.flatten()
    return torch.bincount(chosen, minlength=logits.shape[-1]).max().item() / chosen.numel()


def test_skewed_routing_concentrates_the_choices(built):
    skewed, uniform = _top_expert_share(built[("mixtral-8x7b", "skewed")]), _top_expert_share(built[("mixtral-8x7b", "uniform")])
    assert skewed > 1.5 * uniform and skewed > 0.3, (skewed, uniform)  # uniform: about 1/8 of 2 slots each
