"""--prefetch pregate: a map from a layer's input to the next layer's router, fitted on the run.
Exact tokens against transformers, and on a model whose next-layer routing is a linear
function of the layer's input, the fitted map's picks against the router's own (transformers)."""
import torch

from conftest import engine_tokens, experts_on_host, reference_tokens, token_routed_model
from klotski.prefetch.correlate import warmup_prompts


def test_pregate_gives_transformers_tokens_and_scores_both_predictors_only_when_asked(checkpoints):
    # the experts on the host: predictions move them (where every expert is resident, nothing is predicted)
    host = experts_on_host(checkpoints["gqa"])
    ours, engine = engine_tokens(checkpoints["gqa"], host, batch_size=2, num_batches=3, prefetch="pregate")
    assert ours == reference_tokens(checkpoints["gqa"])
    report = engine.predictor.report()
    assert report["pregated_share"] > 0  # the maps were fitted during the run and predicted
    # not asked to compare: no next gate fetched ahead nor computed, nothing scored beside
    assert not engine.pipeline.next_gate and "alongside" not in report
    assert engine.memory.peak <= engine.memory.budget  # the maps and features were charged and fit
    ours, engine = engine_tokens(checkpoints["gqa"], host, batch_size=2, num_batches=3, prefetch="pregate",
                                 prefetch_compare=True)
    assert ours == reference_tokens(checkpoints["gqa"])
    report = engine.predictor.report()
    assert engine.pipeline.next_gate
    for name in ("pre-gate", "next-gate"):  # scored on the same layer-steps
        scored = report["alongside"][name]
        assert 0 < scored["precision"] <= 1 and 0 < scored["recall"] <= 1, name
    assert engine.memory.peak <= engine.memory.budget


def test_prefetch_compare_without_pregate_is_one_line():
    import pytest
    from klotski.config import ConfigError, RunConfig
    with pytest.raises(ConfigError, match="--prefetch pregate"):
        RunConfig(prefetch="next-gate", prefetch_compare=True)



def test_fitted_pregate_picks_the_routers_experts_when_routing_is_linear(tmp_path):
    from klotski.io.checkpoint import Checkpoint
    from placement.placement import Placement
    model = token_routed_model(tmp_path / "linear")
    # bs and n given and every group on the device: no plan (the maps learn the same either way)
    placement = Placement.by_kind(Checkpoint.open(str(model)).spec.group_keys(), kv="device")
    _, engine = engine_tokens(model, placement, prompts=warmup_prompts(8, 24), max_new_tokens=4, batch_size=4,
                              num_batches=2, prefetch="pregate")
    maps = engine.predictor.maps
    assert all(maps.fitted(m) for m in range(1, maps.moe_layers))
    # the reference: transformers' own router logits and hidden states, on text the run never saw
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = tok(" ".join(warmup_prompts(12, 24)[8:]), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = hf(ids, output_router_logits=True, output_hidden_states=True)
    k = hf.config.num_experts_per_tok
    shares = []
    for m in range(1, maps.moe_layers):  # layer m's picks from layer m-1's input
        x = out.hidden_states[m - 1][0]
        picked = maps.picks(m, maps.features([x[None]], [None]), k)
        truth = torch.topk(out.router_logits[m].reshape(-1, hf.config.num_local_experts), k).indices
        shares.append(sum(len(set(a) & set(b)) for a, b in zip(picked.tolist(), truth.tolist())) / truth.numel())
    assert min(shares) >= 0.97, shares


def test_the_plan_counts_the_maps_bytes_the_pipeline_holds():
    """The run is planned for the device budget less maps_nbytes; the pipeline reserves what
    place() made: the two must agree (a hidden size past the rank: the projection counts too)."""
    from types import SimpleNamespace
    from klotski.prefetch.pregate import PREGATE_RANK, PregateMaps, maps_nbytes
    for hidden in (64, PREGATE_RANK + 44):
        shape = SimpleNamespace(num_layers=3, hidden_size=hidden, num_experts=8, experts_in=lambda j: 8 * (j > 0))
        maps = PregateMaps(hidden, 8, 2, 1e-5)
        assert maps_nbytes(shape) == maps.place(torch.device("cpu")), hidden
