"""Shared fixtures: tiny checkpoints built once per session, transformers as the reference."""
import functools
import pytest
import torch

from klotski.builtin import tiny
from klotski.config import RunConfig
from klotski.assemble import open_engine
from klotski.io.requests import Request

PROMPTS = [
    "The history of the city begins",
    "Quantum mechanics is a fundamental theory in physics that describes the behaviour of nature at small scales",
    "Paris",
    "A river is a natural flowing watercourse",
    "The album was recorded in London during the winter of 1971 and released the following spring",
    "Mount Everest",
]

VARIANTS = {
    "gqa": {},
    "window": {"sliding_window": 6, "num_hidden_layers": 3},
    "mha-tied-sharded": {"num_key_value_heads": 4, "tie_word_embeddings": True, "num_shards": 3},
}


# `make test` runs a file per worker on two workers (pytest-xdist, --dist loadfile), in the order
# collected: the longest files go first, so that neither worker is left alone with one at the end.
LONGEST_FILES = ("test_smollm.py", "test_bench.py", "test_bench_gpu.py")  # longest first


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: each file stays in one piece


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory):
    """Correlation tables, profiles and built-in models go to a fresh cache, not the user's."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    # runs do not correct the session's profiles (learning.learn_from_run): a test's plan must not
    # depend on which tests ran before it; tests/test_profile_learning.py calls it directly
    mp.setattr("klotski.generate.learn_from_run", lambda *a, **kw: None)
    yield
    mp.undo()


@pytest.fixture(scope="session", autouse=True)
def exact_fp32():
    """fp32 means fp32 on a GPU too: no TF32 in matmuls or convolutions (the GPU tests compare
    tokens and hidden states with transformers' fp32 and between placements)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, kw in VARIANTS.items():
        kw = dict(kw)
        shards = kw.pop("num_shards", 1)
        out[name] = tiny.build_checkpoint(root / name, "tiny", num_shards=shards, **kw)
    out["fused"] = tiny.build_checkpoint(root / "fused", "tiny", fused_experts=True)
    return out


def token_routed_model(folder):
    """tiny-mixtral with every attention output and expert output zeroed, saved in `folder`: each
    layer's input is the token's embedding, so a token's experts at every layer depend on the
    token alone, and layer m's router scores are a linear function of layer m-1's
    RMS-normalised input."""
    from safetensors.torch import load_file, save_file
    model = tiny.build_checkpoint(folder, "tiny")
    for path in model.glob("*.safetensors"):
        weights = load_file(path)
        for name in weights:
            if name.endswith(("o_proj.weight", "w2.weight", "down_proj.weight")):
                weights[name] = torch.zeros_like(weights[name])
        save_file(weights, path, metadata={"format": "pt"})
    return model


def requests(prompts=PROMPTS, max_new_tokens=10):
    return [Request(id=f"r{i}", line=i + 1, prompt=p, messages=None, max_new_tokens=max_new_tokens)
            for i, p in enumerate(prompts)]


def reference_tokens(model_dir, prompts=PROMPTS, max_new_tokens=10):
    """transformers' own batched greedy generate, left-padded, fp32: token ids per prompt up to EOS."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    return reference_tokens_of(model_dir, [tok(p)["input_ids"] for p in prompts], max_new_tokens)


def reference_tokens_of(model_dir, id_lists, max_new_tokens=10):
    """The same for prompts given as token ids (chat prompts rendered by the engine's own path)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(map(len, id_lists))
    ids = torch.tensor([[pad] * (width - len(x)) + list(x) for x in id_lists])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in id_lists])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    result = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        result.append(row[:cut])
    return result


def engine_tokens(model_dir, placement=None, prompts=PROMPTS, max_new_tokens=10, close=True, **config):
    cfg = RunConfig(model=str(model_dir), progress=False, dtype="float32", **config)
    engine, seqs, errors = open_engine(cfg, requests(prompts, max_new_tokens), placement=placement)
    assert not errors
    done = {s.request.id: s.out for s in engine.run(seqs)}
    if close:
        engine.close()
    return [done[f"r{i}"] for i in range(len(prompts))], engine


def run_keeping_states(engine, seqs, sync: bool = False):
    """Run `seqs` to the end keeping every layer's hidden states (device copies); with `sync`
    the device is synchronised after every layer (the GPU tests' reference). Closes the
    engine; returns (outputs by request id, states)."""
    states = []

    def keep(layer, hs):
        states.append([h.clone() for h in hs])
        if sync:
            torch.cuda.synchronize()
    engine.pipeline.on_layer = keep
    done = {s.request.id: s.out for s in engine.run(seqs)}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    engine.close()
    return done, states


# ---- one model's runs under different placements, compared bit for bit (tests/gpu/test_gpu.py,
# tests/test_placement_bits.py) ------------------------------------------------------------
PLACEMENTS = {  # kind -> tier, and where the KV cache lives
    "resident": dict(kv="device"),
    "host": dict(kv="host", attn="host", gate="host", expert="host", head="host", embed="host"),
    "disk": dict(kv="host", attn="host", gate="host", expert="disk"),
    "mixed": dict(kv="device", attn="host", expert="disk"),
}


@functools.lru_cache(maxsize=None)
def placement_of(model_dir, kind):
    from placement.placement import Placement
    _, probe = engine_tokens(model_dir, prompts=["x"], max_new_tokens=1, device="cpu")
    tiers = dict(PLACEMENTS[kind])
    return Placement.by_kind(probe.spec.group_keys(), kv=tiers.pop("kv"), **tiers)


def placed_run(model_dir, kind="resident", *, device, sync=False, max_new_tokens=8, **config):
    """Tokens and per-layer hidden states (device copies, compared after the run) of one run
    with the placement `kind` (PLACEMENTS), 3 x 2 batches of PROMPTS in fp32. CPU compute on one
    thread: a CPU matmul's bits depend on its thread count, which a run otherwise sizes to the
    cores free at the time (util/threads.py; under make test's two workers, one run got two and
    the other one)."""
    cfg = RunConfig(model=str(model_dir), progress=False, dtype="float32", device=device,
                    batch_size=3, num_batches=2, **{"threads": 1, **config})
    engine, seqs, errors = open_engine(cfg, requests(PROMPTS, max_new_tokens), placement=placement_of(model_dir, kind))
    assert not errors
    done, states = run_keeping_states(engine, seqs, sync)
    return [done[f"r{i}"] for i in range(len(PROMPTS))], states, engine


def assert_same(got, ref, what):
    """Two placed runs: the same tokens and, at every layer-step, the same hidden states' bits."""
    tokens, states, _ = got
    ref_tokens, ref_states, _ = ref
    assert tokens == ref_tokens, what
    assert len(states) == len(ref_states), what
    for step, (a, b) in enumerate(zip(states, ref_states)):
        for batch, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"{what}: hidden states differ at layer-step {step}, {difference(x, y, batch)}"


def difference(x, y, batch) -> str:
    """Where two hidden states differ, for the failure message: which batch, rows and tokens,
    how many values and by how much (a few rows of last bits point at a kernel's choice of
    tiling; whole rows or large values at a misplaced byte or a race)."""
    if x.shape != y.shape:
        return f"batch {batch}: shapes {tuple(x.shape)} and {tuple(y.shape)}"
    diff = (x.float() - y.float()).abs()
    where = (x != y).nonzero().tolist()
    rows = sorted({tuple(i[:-1]) for i in where})
    return (f"batch {batch} of shape {tuple(x.shape)}: {len(where)} of {x.numel()} values differ, max |diff| "
            f"{diff.max().item():.3g}, in {len(rows)} (row, token) places, the first {rows[:8]}")


def experts_on_host(model):
    """Every expert on the host tier: a prediction moves them (where every expert is resident,
    nothing is predicted)."""
    from placement.placement import Placement
    return Placement.by_kind(group_keys(model), expert="host")


def group_keys(model):
    from klotski.io.checkpoint import Checkpoint
    ckpt = Checkpoint.open(str(model))
    keys = ckpt.spec.group_keys()
    ckpt.close()
    return keys
