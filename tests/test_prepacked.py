"""A CPU's bf16 resident SwiGLU experts reordered once for oneDNN (issue 60, models/prepacked.py):
each expert's products are F.linear's bit for bit, a wave over the reordered stack is the
per-expert SwiGLU written out here, an expert's rows are its own (a swap is caught), and a run
holding its stacks so makes the tokens of one holding them as read."""
import pytest
import torch
import torch.nn.functional as F

from klotski.models import grouped as G
from klotski.models import prepacked

pytestmark = pytest.mark.skipif(not prepacked.available(), reason="no oneDNN bf16 products on this CPU")

H, I = 128, 192


def experts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).bfloat16()  # noqa: E731
    return [{"w1": make(I, H), "w3": make(I, H), "w2": make(H, I)} for _ in range(n)]


def reference(x, w):
    """One expert's SwiGLU as layers.swiglu writes it, over plain weights."""
    return F.linear(F.silu(F.linear(x, w["w1"])) * F.linear(x, w["w3"]), w["w2"])


def packed_stack(ws):
    rows = [prepacked.pack_expert(w) for w in ws]
    return {n: [r[n] for r in rows] for n in rows[0]}


@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_a_reordered_product_is_f_linear_bit_for_bit(rows):
    w = experts(1)[0]["w2"]
    x = torch.randn(rows, I).bfloat16()
    assert torch.equal(prepacked.product(x, prepacked.reorder(w)), F.linear(x, w))


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 9], [8, 8, 8, 8], [0, 0, 0, 0]])
def test_a_wave_over_the_reordered_stack_is_each_experts_swiglu(counts):
    ws = experts(4)
    stack = packed_stack(ws)
    assert prepacked.held(stack) and not prepacked.held({n: torch.stack([w[n] for w in ws]) for n in ws[0]})
    extra = 2  # rows past the groups' total: no group's (zeros)
    x = torch.randn(sum(counts) + extra, H).bfloat16()
    offsets = torch.tensor(counts).cumsum(0).int()
    y = G.grouped_swiglu(x, stack, G.Groups(counts, offsets))
    start = 0
    for g, c in enumerate(counts):
        assert torch.equal(y[start:start + c], reference(x[start:start + c], ws[g])), f"expert {g}"
        start += c
    assert torch.equal(y[start:], torch.zeros(extra, H, dtype=y.dtype))


def test_a_swapped_expert_is_caught():
    ws = experts(3, seed=1)
    stack = packed_stack(ws)
    stack["w13"][0], stack["w13"][1] = stack["w13"][1], stack["w13"][0]  # the planted fault
    x = torch.randn(4, H).bfloat16()
    y = G.grouped_swiglu(x, stack, G.Groups([2, 2, 0], torch.tensor([2, 4, 4]).int()))
    assert not torch.equal(y[:2], reference(x[:2], ws[0]))


def test_only_bf16_cpu_swiglu_stacks_of_whole_blocks_take_the_form():
    w = experts(1)[0]
    assert prepacked.packs(w)
    assert not prepacked.packs({n: t.float() for n, t in w.items()})
    assert not prepacked.packs({"w1": w["w1"][:100], "w3": w["w3"][:100], "w2": w["w2"][:, :100]})
    assert G.stack_form(G.grouped_swiglu, "cpu", torch.bfloat16) is prepacked
    assert G.stack_form(G.grouped_swiglu, "cpu", torch.float32) is None
    assert G.stack_form(G.grouped_swiglu, "cuda", torch.bfloat16) is None
    assert G.stack_form(G.grouped_mm, "cpu", torch.bfloat16) is None


@pytest.mark.parametrize("moved", [False, True])
def test_a_run_with_reordered_weights_makes_the_tokens_of_one_without(tmp_path, moved):
    """bf16 on a CPU, the experts kept decoded from Q8_0 blocks: the stacks and projections are
    reordered (auto) or as read (off); greedy tokens equal, and the engine's bytes the same. With
    `moved`, every other expert lives on the host and moves in per use (plain, beside the
    resident ones' reordered stack)."""
    pytest.importorskip("gguf")
    import gguf_models as gm
    from conftest import PROMPTS, requests
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.io.checkpoint import Checkpoint
    from placement.placement import Placement

    path = gm.write(tmp_path / "m.gguf", "Q8_0", gm.QWEN3)
    ckpt = Checkpoint.open(str(path))
    keys = ckpt.spec.group_keys()
    ckpt.close()
    runs = {}
    for mode in ("auto", "off"):
        cfg = RunConfig(model=str(path), progress=False, dtype="bfloat16", batch_size=3, num_batches=1,
                        reordered_weights=mode)
        placement = Placement.by_kind(keys)
        if moved:
            placement = Placement({k: "host" if k[0] == "expert" and k[2] % 2 else t for k, t in placement.tiers.items()},
                                  placement.kv)
        engine, seqs, errors = open_engine(cfg, requests(PROMPTS, 8), placement=placement)
        assert not errors
        forms = {stack.form for stack in engine.cache.stacks.values()}
        layouts = {n: t.layout for key, w in engine.cache.resident.items() if key[0] in ("attn", "head")
                   for n, t in w.items() if t.dim() == 2}
        done = {s.request.id: s.out for s in engine.run(seqs)}
        assert engine.pipeline.experts_loaded > 0 if moved else engine.pipeline.experts_loaded == 0
        runs[mode] = ([done[f"r{i}"] for i in range(len(PROMPTS))], forms, layouts, engine.host_memory.peak,
                      engine.memory.peak)
        engine.close()
    assert runs["auto"][1] == {prepacked} and runs["off"][1] == {None}
    reordered = {n for n, layout in runs["auto"][2].items() if layout != torch.strided}
    assert reordered == {"q", "k", "v", "o", "lm_head"} and set(runs["off"][2].values()) == {torch.strided}
    assert runs["auto"][0] == runs["off"][0]
    assert runs["auto"][3:] == runs["off"][3:]
