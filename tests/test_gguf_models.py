"""GGUF checkpoints end to end: small Qwen3-MoE / Qwen2-MoE files written with the `gguf`
package run token-identical to transformers loading the same file (`gguf_file=`), experts kept
in their GGUF blocks on every tier and on the link."""
import json
import math

import pytest
import torch

pytest.importorskip("gguf")

import gguf_models as gm  # noqa: E402
from conftest import PROMPTS, engine_tokens  # noqa: E402
from klotski.io import gguf as kg  # noqa: E402
from klotski.io.checkpoint import Checkpoint  # noqa: E402
from placement.placement import Placement  # noqa: E402
from placement.store import CheckpointError  # noqa: E402


def hf_gguf_tokens(path, max_new_tokens=10):
    """transformers' greedy fp32 generate on the GGUF file itself (left-padded batch)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    kg._give_gguf_a_version()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    pad, width = tok.pad_token_id, max(map(len, ids))
    x = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad)
    return [r[:next((k for k, t in enumerate(r) if t == tok.eos_token_id), len(r))] for r in out[:, width:].tolist()]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    made = {}

    def make(name, *args, **kw):
        if name not in made:
            d = tmp_path_factory.mktemp(name)
            made[name] = gm.write(d / "model.gguf", *args, **kw)
        return made[name]
    return make


CASES = {  # name: (expert type, shape, write options)
    "qwen3-Q8_0": ("Q8_0", gm.QWEN3, {}),
    "qwen3-Q4_0-per-expert": ("Q4_0", gm.QWEN3, {"merged": False}),
    "qwen3-Q4_K": ("Q4_K", gm.QWEN3, {}),
    "qwen3-Q5_K": ("Q5_K", gm.QWEN3, {}),
    "qwen3-Q6_K-q8-attention": ("Q6_K", gm.QWEN3, {"attn_qtype": "Q8_0"}),
    "qwen3-Q4_K_M-like": ({"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, gm.QWEN3, {}),
    "qwen2-Q4_0": ("Q4_0", gm.QWEN2, {}),
    "qwen2-Q8_0": ("Q8_0", gm.QWEN2, {"attn_qtype": "Q8_0"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_token_identical_to_transformers_gguf(files, case):
    qtype, shape, kw = CASES[case]
    path = files(case, qtype, shape, **kw)
    # transformers reads merged expert tensors only: the per-expert file is checked against it
    # on the merged file of the same weights (same seed)
    ref = hf_gguf_tokens(path if kw.get("merged", True) else files(case + "-merged", qtype, shape))
    assert sum(len(set(t)) for t in ref) > 2 * len(PROMPTS)  # real, varied generations
    ours, engine = engine_tokens(path, batch_size=len(PROMPTS))
    assert ours == ref
    assert tight_run(path, engine) == ref


def tight_run(path, engine):
    """Tokens under a tight device budget (experts streamed in their blocks): a quarter of the
    packed model, or, when the planner refuses that, the minimum it names."""
    from klotski.planning import BudgetRefused
    budget = sum(engine.cache.moved.values()) // 4
    try:
        ours, engine = engine_tokens(path, device_memory=budget, batch_size=3, num_batches=2)
    except BudgetRefused as e:
        # the minimum itself: the KV of the next layer once came ahead into the room a GGUF
        # expert's decode then needed, 3 KB over (the planner holds one or the other)
        budget = math.ceil(e.needed)
        ours, engine = engine_tokens(path, device_memory=budget, batch_size=3, num_batches=2)
    assert engine.memory.peak <= budget and engine.pipeline.experts_loaded > 0
    return ours


def test_experts_stay_packed_and_sized_as_stored(files):
    path = files("qwen3-Q4_K", "Q4_K", gm.QWEN3)
    ckpt = Checkpoint.open(str(path))
    H, I = gm.QWEN3["hidden"], gm.QWEN3["moe_inter"]
    stored = (2 * I * (H // 256) + H * (I // 256)) * 144  # w1, w3 [I, H] and w2 [H, I] in Q4_K blocks
    sizes = ckpt.group_bytes(torch.bfloat16)
    assert sizes.expert == stored and sizes.expert_decoded == 3 * H * I * 2
    parts = ckpt.expert_codec(torch.bfloat16).read(("expert", 1, 2))
    assert {n: t.dtype for n, t in parts.items()} == {f"{w}.Q4_K": torch.uint8 for w in ("w1", "w3", "w2")}


def test_opening_a_file_parses_its_metadata_once(files):
    """Klotski reads a GGUF file's metadata once per open (the reader parses the whole vocabulary:
    seconds on a real file), and again once the file changes."""
    path = files("qwen3-Q8_0", "Q8_0", gm.QWEN3)
    kg.parsed.cache_clear()
    Checkpoint.open(str(path)).close()
    assert kg.parsed.cache_info().misses == 1
    Checkpoint.open(str(path)).close()
    assert kg.parsed.cache_info().misses == 1
    stat = path.stat()
    import os
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    Checkpoint.open(str(path)).close()
    assert kg.parsed.cache_info().misses == 2


def test_q4k_moves_under_a_third_of_bf16(files, tmp_path):
    """Bytes over the link per decode step, experts on the host: Q4_K blocks against the same
    weights as a bf16 safetensors checkpoint (the run report's io bytes)."""
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from conftest import requests
    path = files("qwen3-Q4_K", "Q4_K", gm.QWEN3)
    bf16 = to_safetensors(path, tmp_path / "bf16", torch.bfloat16)

    def per_step(model):
        keys = Checkpoint.open(str(model)).spec.group_keys()
        cfg = RunConfig(model=str(model), progress=False, dtype="bfloat16", batch_size=len(PROMPTS), num_batches=1)
        engine, seqs, _ = open_engine(cfg, requests(PROMPTS, 8), placement=Placement.by_kind(keys, expert="host"))
        list(engine.run(seqs))
        engine.close()
        return sum(engine.trace.bytes.values()) / engine.stats.decode_steps, engine.pipeline.experts_loaded

    (q4k, loaded_q), (full, loaded_b) = per_step(path), per_step(bf16)
    assert loaded_q == loaded_b  # every expert of every layer each step: the same work moved
    print(f"bytes per decode step: Q4_K {q4k:.0f}, bf16 {full:.0f}, ratio {q4k / full:.4f}")
    assert q4k <= 0.32 * full


def to_safetensors(path, out, dtype):
    """The GGUF model's weights dequantized into a Hugging Face checkpoint (per-expert names)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer
    out.mkdir()
    store = kg.GgufStore(kg.files(path))
    save_file({n: store.read(n).to(dtype).contiguous() for n in store.entries}, str(out / "model.safetensors"))
    store.close()
    cfg = kg.read_config(path)
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg))
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    return out


def test_refusals(files, tmp_path):
    from klotski.assemble import open_engine
    from klotski.config import RunConfig
    from klotski.errors import ConfigError
    from conftest import requests
    path = files("qwen3-Q8_0", "Q8_0", gm.QWEN3)
    with pytest.raises(ConfigError, match="GGUF checkpoint"):
        open_engine(RunConfig(model=str(path), progress=False, quantize="hqq4"), requests(["x"], 1))
    odd = gm.write(tmp_path / "q2k.gguf", "Q8_0", gm.QWEN3)
    patch_type(odd, "blk.1.ffn_down_exps.weight", 10)  # Q2_K, same block size (256) class
    with pytest.raises(CheckpointError, match=r"blk\.1\.ffn_down_exps\.weight is stored as Q2_K"):
        Checkpoint.open(str(odd))


def patch_type(path, name, new_type: int):
    """Rewrite tensor `name`'s ggml type id in the file's tensor info."""
    from gguf import GGUFReader
    reader = GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == name)
    at = int(t.field.offset) + 8 + len(name.encode()) + 4 + 8 * len(t.shape)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(new_type.to_bytes(4, "little"))


@pytest.mark.parametrize("qtype,merged", [("Q4_K", True), ("Q6_K", False)])
def test_mixtral_llama_gguf(tmp_path, qtype, merged):
    """A `llama` GGUF with expert tensors (Mixtral): transformers reads it as a dense Llama and
    drops the experts, so the reference is transformers on the same weights written by the test
    as a safetensors checkpoint. Attention is Q8_0 with q/k rows permuted as llama.cpp stores
    them: the un-permute on read is checked here."""
    from conftest import reference_tokens
    hf = {}
    path = gm.write(tmp_path / "mixtral.gguf", qtype, gm.MIXTRAL, hf=hf, attn_qtype="Q8_0", merged=merged)
    ref = reference_tokens(gm.write_reference(hf, path, tmp_path / "ref"))
    assert sum(len(set(t)) for t in ref) > 2 * len(PROMPTS)
    ours, engine = engine_tokens(path, batch_size=len(PROMPTS))
    assert engine.spec.shape.model_type == "mixtral" and ours == ref
    assert tight_run(path, engine) == ref


def test_split_files(files, tmp_path):
    """A folder of split files (and one split named as --model) runs the same weights as the one-file
    model written with the same seed, token-identical to transformers on that file."""
    single = files("qwen3-Q8_0", "Q8_0", gm.QWEN3)
    split = tmp_path / "split"
    split.mkdir()
    gm.write(split / "model.gguf", "Q8_0", gm.QWEN3, split_max_tensors=10)
    names = sorted(p.name for p in split.iterdir())
    assert names == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    ref = hf_gguf_tokens(single)
    assert engine_tokens(split, batch_size=len(PROMPTS))[0] == ref
    assert Checkpoint.open(str(split / names[1])).store.files == [split / n for n in names]


def test_gpt_oss_gguf(tmp_path):
    """A gpt-oss GGUF as llama.cpp writes one (separate MXFP4 gate/up/down experts with biases,
    sinks, yarn): transformers cannot read it, so the reference is transformers on the same
    weights in its unquantized layout (gate and up interleaved). Experts stay MXFP4 blocks, sized
    as stored; the device decode joins gate and up into the family's layout."""
    from conftest import reference_tokens
    hf = {}
    path = gm.write_gpt_oss(tmp_path / "gpt-oss.gguf", hf)
    ref = reference_tokens(gm.write_reference(hf, path, tmp_path / "ref"))
    assert sum(len(set(t)) for t in ref) > 2 * len(PROMPTS)
    ckpt = Checkpoint.open(str(path))
    H, I = gm.GPT_OSS["hidden"], gm.GPT_OSS["inter"]
    parts = ckpt.expert_codec(torch.float32).read(("expert", 1, 2))
    assert {n: t.dtype for n, t in parts.items() if t.dtype == torch.uint8} == \
        {f"{m}.MXFP4": torch.uint8 for m in ("gate", "up", "down")}
    assert ckpt.group_bytes(torch.float32).expert == 3 * H * I // 32 * 17 + (2 * I + H) * 4  # blocks + fp32 biases
    ours, engine = engine_tokens(path, batch_size=len(PROMPTS))
    assert engine.spec.shape.model_type == "gpt_oss" and ours == ref
    assert tight_run(path, engine) == ref
