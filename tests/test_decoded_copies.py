"""A CPU run's GGUF experts kept decoded in host RAM (issue 60: `--decoded-copies`,
klotski/planning.decoded_copies, WeightCache's `kept`): the copy is the per-use decode's weights
bit for bit, fp32 tokens are the per-use path's, the copy is charged to the host budget, and a
host budget too small for it falls back to the blocks decoded per use, saying so."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("gguf")

import gguf_models as gm  # noqa: E402
from conftest import PROMPTS, requests  # noqa: E402
from klotski.compress.ggml import GgufCodec  # noqa: E402
from klotski.io.checkpoint import Checkpoint  # noqa: E402
from placement.placement import Placement  # noqa: E402

SHAPE = dict(gm.QWEN3, layers=1)


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    return gm.write(tmp_path_factory.mktemp("kept") / "m.gguf", "Q8_0", SHAPE)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_copy_is_the_per_use_decode(tmp_path, qtype, dtype):
    ckpt = Checkpoint.open(str(gm.write(tmp_path / "m.gguf", qtype, SHAPE)))
    key = ("expert", 0, 1)
    kept = GgufCodec(ckpt.store, ckpt.spec, dtype, on_cpu=True).kept_copy(key)  # (never the int4 form)
    per_use = GgufCodec(ckpt.store, ckpt.spec, dtype)
    want = per_use.decode(per_use.read(key))
    assert set(kept) == set(want) == {"w1", "w2", "w3"}
    assert all(kept[n].dtype == dtype and torch.equal(kept[n], want[n]) for n in want)
    ckpt.close()


def run(path, **config):
    """fp32 greedy tokens, every group on the device, a given batch shape (no plan to measure)."""
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    ckpt = Checkpoint.open(str(path))
    keys = ckpt.spec.group_keys()
    ckpt.close()
    cfg = RunConfig(model=str(path), progress=False, dtype="float32", batch_size=3, num_batches=1, **config)
    engine, seqs, errors = open_engine(cfg, requests(PROMPTS, 8), placement=Placement.by_kind(keys))
    assert not errors
    done = {s.request.id: s.out for s in engine.run(seqs)}
    engine.close()
    return [done[f"r{i}"] for i in range(len(PROMPTS))], engine


def test_kept_copies_run_as_the_blocks_do_and_are_charged_to_the_host(q8, capsys):
    per_use, blocks = run(q8, decoded_copies="off")
    assert not blocks.cache.kept and blocks.setup.decoded_copies["mode"] == "off"
    kept, engine = run(q8)
    experts = {k for k in engine.cache.placement.tiers if k[0] == "expert"}
    assert engine.cache.kept == experts and not any(engine.cache.needs_decode(k) for k in experts)
    assert kept == per_use
    copies = engine.setup.decoded_copies
    assert copies["mode"] == "on" and copies["bytes"] == sum(engine.cache.full[k] for k in experts)
    assert engine.host_memory.peak >= copies["bytes"] and engine.host_memory.peak <= engine.host_memory.budget
    assert f"host weights: kept float32 copy of {len(experts)} experts" in capsys.readouterr().err


def test_a_host_budget_too_small_falls_back_to_the_blocks(q8, capsys):
    ckpt = Checkpoint.open(str(q8))
    need = sum(ckpt.group_nbytes(k, torch.float32)[1] for k in ckpt.spec.group_keys() if k[0] == "expert")
    ckpt.close()
    tokens, engine = run(q8, host_memory=need - 1)
    assert not engine.cache.kept and engine.setup.decoded_copies["mode"] == "off"
    assert engine.host_memory.peak < need
    assert "stay in their blocks" in capsys.readouterr().err
    assert tokens == run(q8, decoded_copies="off")[0]


def test_the_choice_per_form_and_batch(tmp_path):
    """Q4_0 in bf16 keeps the int4 kernel below KEPT_BEATS_INT4_ROWS decode rows an expert call and
    a copy from there; Q4_K and fp32 keep a copy; a host budget short of it keeps the blocks; off is off."""
    from types import SimpleNamespace
    from klotski.config import RunConfig
    from klotski.planning import KEPT_BEATS_INT4_ROWS, decoded_copies
    from placement.tiers import Budgets
    cpu, room = torch.device("cpu"), Budgets(1 << 40, 1 << 40)
    E, k = SHAPE["experts"], SHAPE["top_k"]
    few, many = [None] * ((KEPT_BEATS_INT4_ROWS * E - 1) // k), [None] * (KEPT_BEATS_INT4_ROWS * E // k)
    cfg = SimpleNamespace(**{f: getattr(RunConfig, f) for f in ("decoded_copies", "batch_size", "num_batches")})
    q4_0 = Checkpoint.open(str(gm.write(tmp_path / "a.gguf", "Q4_0", SHAPE)))
    q4_k = Checkpoint.open(str(gm.write(tmp_path / "b.gguf", "Q4_K", SHAPE)))
    assert decoded_copies(cfg, q4_0, torch.bfloat16, cpu, room, few)["mode"] == "off"
    assert decoded_copies(cfg, q4_0, torch.bfloat16, cpu, room, many)["mode"] == "on"
    assert decoded_copies(cfg, q4_0, torch.float32, cpu, room, few)["mode"] == "on"
    assert decoded_copies(cfg, q4_k, torch.bfloat16, cpu, room, few)["mode"] == "on"
    short = decoded_copies(cfg, q4_k, torch.bfloat16, cpu, Budgets(1 << 40, 1 << 10), few)
    assert short["mode"] == "off" and short["say"]
    assert decoded_copies(SimpleNamespace(**{**vars(cfg), "decoded_copies": "off"}), q4_k, torch.bfloat16, cpu,
                          room, few)["mode"] == "off"
    q4_0.close()
    q4_k.close()



def test_float_experts_are_read_once_and_stacked_without_a_byte_added(tmp_path, capsys):
    """Experts stored as floats of the compute dtype's width (F32 here, fp32 run) are converted
    once in place of their blocks and stacked (no per-use conversion): nothing charged to the
    host, the tokens of the per-use path."""
    path = gm.write(tmp_path / "f.gguf", "F32", SHAPE)
    per_use, blocks = run(path, decoded_copies="off")
    assert not blocks.cache.kept
    tokens, engine = run(path)
    experts = {k for k in engine.cache.placement.tiers if k[0] == "expert"}
    assert engine.cache.kept == experts and engine.setup.decoded_copies == {**engine.setup.decoded_copies,
                                                                           "mode": "on", "bytes": 0}
    assert not any(engine.cache.needs_decode(k) for k in experts) and set(engine.cache.stacks) == {0}
    assert engine.host_memory.peak == blocks.host_memory.peak  # no byte added
    assert tokens == per_use
    assert "floats read once into float32 and stacked" in capsys.readouterr().err


def test_a_plan_refused_for_the_copy_is_made_again_without_it(q8, monkeypatch, capsys):
    """The plan is made with the copy's bytes taken from the host budget; where that is refused,
    it is made again with the whole budget, the experts staying in their blocks, said once."""
    from klotski import assemble, planning
    from klotski.config import RunConfig
    from klotski.schedule.sequences import prepare
    from planner.solve import Infeasible
    asked = []

    def plan_job(config, ckpt, dtype, device, budgets, *a):
        asked.append((config.decoded_copies, budgets.host))
        if config.decoded_copies == "on":
            raise planning.BudgetRefused(Infeasible("no host room", "host", 1.0, 2.0, 1.0))
        return SimpleNamespace(batch_size=3, num_batches=1, prefill_chunk=1 << 20, longest_prompt=8, precision={},
                               buffers="overlap", schedule="klotski", hot_experts=0)
    monkeypatch.setattr(planning, "plan_job", plan_job)
    ckpt = Checkpoint.open(str(q8))
    cfg = RunConfig(model=str(q8), progress=False, dtype="float32", host_memory=1 << 30, threads=1)
    seqs, _ = prepare(requests(PROMPTS, 4), ckpt.tokenizer, ckpt.spec, cfg)
    setup = assemble.setup_run(cfg, ckpt, seqs, placement=Placement.by_kind(ckpt.spec.group_keys()))
    need = sum(ckpt.group_nbytes(k, torch.float32)[1] for k in ckpt.spec.group_keys() if k[0] == "expert")
    assert asked == [("on", (1 << 30) - need), ("off", 1 << 30)]
    assert setup.decoded_copies["mode"] == "off" and not setup.kept
    assert "leaves the plan no host room" in capsys.readouterr().err
    ckpt.close()


def test_mxfp4_experts_are_kept_decoded_as_their_per_use_decode(tmp_path):
    """gpt-oss's MXFP4 experts (no CPU kernel): kept decoded, and fp32 tokens are the per-use path's."""
    from klotski.builtin.families import build_family, pack_mxfp4
    path = pack_mxfp4(build_family(tmp_path / "fp32", "gpt_oss"), tmp_path / "mxfp4")
    tokens, engine = run(path)
    experts = {k for k in engine.cache.placement.tiers if k[0] == "expert"}
    assert engine.cache.kept == experts and "MXFP4" in engine.setup.decoded_copies["why"]
    assert tokens == run(path, decoded_copies="off")[0]
