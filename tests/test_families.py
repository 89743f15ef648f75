"""Every supported family against transformers' own classes: greedy fp32 tokens identical
with the defaults and, for every schedule and n in {1, 4}, under a device budget of a
quarter of the model; a checkpoint that does not match its config is refused."""
import json

import pytest

from conftest import PROMPTS, engine_tokens, placed_run, reference_tokens
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
    assert engine.spec.shape.model_type == family
    assert ours == family_refs[family]
    assert sum(len(set(t)) for t in ours) > 2 * len(PROMPTS)  # real, varied generations


@pytest.mark.parametrize("schedule", ["klotski", "hot-prefetch", "multibatch", "simple"])
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_quarter_budget_every_schedule(family_models, family_refs, family, schedule, n):
    if schedule == "simple" and n > 1:
        pytest.skip("simple runs one batch")
    if family == "qwen3_5_moe_text" and schedule != "klotski":
        pytest.skip("Qwen3-Next's schedules cover it: the two differ only in the DeltaNet's projections")
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
    ("qwen2_moe", {"mlp_only_layers": [1]}, r"model\.layers\.1\.mlp\.gate_proj\.weight"),  # a dense layer's MLP
    ("olmoe", {"clip_qkv": -1}, r"config\.json: field 'clip_qkv' is -1"),
    ("glm4_moe", {"n_shared_experts": 2}, r"tensor model\.layers\.1\.mlp\.shared_experts\.\w+_proj\.weight has shape"),
    ("minimax_m2", {"num_key_value_heads": 4}, r"tensor model\.layers\.0\.self_attn\.(k_proj|k_norm)\.weight has shape"),
    ("ernie4_5_moe", {"moe_num_shared_experts": 1}, r"mlp\.shared_experts\.gate_proj\.weight has shape"),
    ("ernie4_5_moe", {"moe_layer_start_index": 0}, r"tensor model\.layers\.0\.mlp\.gate\.weight not found"),
    ("llama4_text", {"moe_layers": [0, 1]}, r"tensor model\.layers\.0\.feed_forward\.router\.weight not found"),
    ("llama4_text", {"no_rope_layers": [1, 0, 1, 1]}, r"field 'layer_types' is .*; Llama 4 chunks exactly its RoPE"),
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
    # a sixth: at a quarter the planner keeps qwen2's packed experts resident (moved ones take a
    # pool slot decoded beside their packed row) and moves attention and gates instead
    sixth = sum(engine.cache.full.values()) // 6
    moved, engine = engine_tokens(family_models[family], quantize="hqq4", offload_dir=str(tmp_path / "q"),
                                  device_memory=sixth, batch_size=2, num_batches=3)
    assert moved == resident
    assert engine.pipeline.experts_loaded > 0


def test_llama4_temperature_tuning_scales_each_query_by_its_own_position(tmp_path):
    """Llama 4's NoPE layers scale q by a temperature of its position; floor_scale 4 makes it
    change every few tokens. Each prompt alone (no padding) equals transformers, whose batched
    generate counts the padded slot instead (so the preset keeps floor_scale past every prompt)."""
    tuned = build_family(tmp_path / "tuned", "llama4_text", floor_scale=4, attn_scale=2.0)
    plain = build_family(tmp_path / "plain", "llama4_text", floor_scale=4, attn_temperature_tuning=False)
    for prompt in (PROMPTS[1], PROMPTS[2]):
        ours, _ = engine_tokens(tuned, prompts=[prompt])
        assert ours == reference_tokens(tuned, prompts=[prompt])
    assert ours != reference_tokens(plain, prompts=[prompt])  # the temperature changed the tokens


def test_llama4_vision_language_checkpoint_runs_its_text_model(family_models, family_refs, tmp_path):
    """Llama 4 as published (meta-llama/Llama-4-Scout-17B-16E-Instruct): config `llama4` with the
    text model in `text_config` and its weights under `language_model.`, beside a vision tower
    never read; written by transformers' Llama4ForConditionalGeneration around the preset."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Llama4Config, Llama4ForConditionalGeneration
    src = family_models["llama4_text"]
    text = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                  patch_size=14, projector_input_dim=32, projector_output_dim=64, vision_output_dim=32)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=text.config.to_dict(), vision_config=vision))
    model.language_model.load_state_dict(text.state_dict())
    out = tmp_path / "vl"
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name != "config.json" and "safetensors" not in f.name:
            shutil.copy(f, out / f.name)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama4"
    ours, engine = engine_tokens(out, batch_size=len(PROMPTS))
    assert engine.spec.weights_prefix == "language_model." and engine.spec.shape.model_type == "llama4_text"
    assert ours == family_refs["llama4_text"] == reference_tokens(out)


NEWER = ("glm4_moe", "minimax_m2", "ernie4_5_moe", "llama4_text", "qwen3_next", "qwen3_5_moe_text")  # issue 63's
RUBRIC = "You label passages by their topic. Answer with one word, lower case, no punctuation. Passage: "


@pytest.mark.parametrize("batching", ["static", "continuous"])
@pytest.mark.parametrize("family", NEWER)
def test_a_shared_instruction_is_prefilled_once_and_stays_exact(family_models, family, batching):
    """Each line starts with the same instruction: the prefix cache prefills it once and every
    line reads it; greedy tokens equal transformers' on the whole prompts, static or continuous,
    batches of two rows (so rows are refilled)."""
    prompts = [RUBRIC + p for p in PROMPTS]
    ours, engine = engine_tokens(family_models[family], prompts=prompts, batching=batching, batch_size=2,
                                 num_batches=2)
    assert ours == reference_tokens(family_models[family], prompts=prompts)
    from transformers import AutoTokenizer
    rubric = len(AutoTokenizer.from_pretrained(family_models[family])(RUBRIC)["input_ids"])
    shared = [tokens for _, tokens, _, prefills in engine.stats.prefixes.values() if prefills == 1]
    assert shared and max(shared) >= rubric - 2  # the instruction was one segment, prefilled once


def test_llama4_refuses_sparse_attention_in_one_line(family_models):
    """Llama 4 counts positions from the keys its mask lets a query see; sink/window sparsity
    thins the mask, so its chunks and temperatures would be wrong: refused before loading."""
    from klotski.errors import ConfigError
    with pytest.raises(ConfigError, match=r"--attention sink:2,window:8: llama4_text .* --attention full"):
        engine_tokens(family_models["llama4_text"], attention="sink:2,window:8")


# ---- the linear-attention hybrids (issue 63; their parts: tests/test_hybrid_families.py) ------
@pytest.mark.parametrize("family", ("qwen3_next", "qwen3_5_moe_text"))
def test_hybrid_static_batching_refilled_under_a_quarter_budget_and_the_host_tier(family_models, family_refs, family):
    """More prompts than rows, static groups; and every cache (KV and recurrent state) on the
    host tier: tokens equal transformers', peak device bytes within the budget."""
    path = family_models[family]
    ref = family_refs[family]
    _, probe = engine_tokens(path, prompts=["x"], max_new_tokens=1)
    quarter = sum(probe.cache.full.values()) // 4
    ours, engine = engine_tokens(path, device_memory=quarter, batch_size=2, num_batches=2, batching="static")
    assert ours == ref
    assert engine.memory.peak <= quarter
    tokens, _, engine = placed_run(path, "host", device="cpu")
    assert tokens == reference_tokens(path, max_new_tokens=8)


def test_qwen3_5_vision_language_checkpoint_runs_its_text_model(family_models, family_refs, tmp_path):
    """Qwen3.5/3.6-MoE as published: `qwen3_5_moe` with the text model in `text_config`, its
    weights under `model.language_model.` beside a vision tower never read; written by
    transformers' Qwen3_5MoeForConditionalGeneration around the text preset."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    src = family_models["qwen3_5_moe_text"]
    text = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=14,
                  num_position_embeddings=16)
    model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text.config.to_dict(),
                                                                vision_config=vision))
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    out = tmp_path / "vl"
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name != "config.json" and "safetensors" not in f.name:
            shutil.copy(f, out / f.name)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    ours, engine = engine_tokens(out, batch_size=len(PROMPTS))
    assert engine.spec.weights_prefix == "model.language_model."
    assert engine.spec.shape.model_type == "qwen3_5_moe_text"
    assert ours == family_refs["qwen3_5_moe_text"] == reference_tokens(out)


def test_hybrids_refuse_sparse_attention_in_one_line(family_models):
    from klotski.errors import ConfigError
    with pytest.raises(ConfigError, match=r"--attention sink:2,window:8: qwen3_next's linear-attention .* --attention full"):
        engine_tokens(family_models["qwen3_next"], attention="sink:2,window:8")


# ---- the Family Protocol: every hook of every family module, no probing -------------------
def _protocol():
    """The Protocol's constants {name: type} and functions {name: signature without self}."""
    import inspect
    import typing

    from klotski.models.family import Family
    constants = typing.get_type_hints(Family)
    functions = {n: inspect.signature(f) for n, f in vars(Family).items()
                 if inspect.isfunction(f) and not n.startswith("_")}
    return constants, {n: s.replace(parameters=list(s.parameters.values())[1:]) for n, s in functions.items()}


def _of_type(value, kind) -> bool:
    import typing
    if typing.get_origin(kind) is tuple:  # tuple[str, ...]
        item = typing.get_args(kind)[0]
        return isinstance(value, tuple) and all(isinstance(v, item) for v in value)
    if typing.get_origin(kind) is dict:  # dict[str, tuple[str, ...]]
        keys, values = typing.get_args(kind)
        return isinstance(value, dict) and all(_of_type(k, keys) and _of_type(v, values) for k, v in value.items())
    return isinstance(value, kind)


def _callable_as(signature, declared) -> bool:
    """`signature` takes every call `declared` allows: the same parameters first, by name, kind
    and whether they may be left out; any more of its own may be left out."""
    import inspect
    have, want = list(signature.parameters.values()), list(declared.parameters.values())
    if len(have) < len(want):
        return False
    for h, w in zip(have, want):
        if h.name != w.name or h.kind != w.kind or (w.default is not inspect.Parameter.empty
                                                    and h.default is inspect.Parameter.empty):
            return False
    return all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in have[len(want):])


def protocol_breaches(module) -> list[str]:
    """What `module` lacks or gets wrong of the Family Protocol; [] when it satisfies it."""
    import inspect
    constants, functions = _protocol()
    out = []
    for name, kind in constants.items():
        if name not in vars(module):
            out.append(f"{name} missing")
        elif not _of_type(vars(module)[name], kind):
            out.append(f"{name} is {vars(module)[name]!r}, not {kind}")
    for name, declared in functions.items():
        hook = vars(module).get(name)
        if hook is None:
            out.append(f"{name} missing")
        elif not callable(hook):
            out.append(f"{name} is not callable")
        elif not _callable_as(inspect.signature(hook), declared):
            out.append(f"{name}{inspect.signature(hook)} does not take {name}{declared}")
    return out


def test_the_protocol_states_every_hook_and_each_says_what_it_is_for():
    from klotski.models.family import Family
    constants, functions = _protocol()
    assert set(constants) == {"MODEL_TYPE", "QUANTIZATION", "HOST_ATTENTION", "SHARED_PREFIX", "SPARSE_ATTENTION",
                              "LINEAR_WEIGHTS"}
    assert {"check_config", "group_refs", "attention_block", "route", "bind_expert_ffn"} <= set(functions)
    assert all(vars(Family)[n].__doc__ for n in functions)


def test_every_family_module_satisfies_the_protocol():
    from klotski.models.spec import FAMILIES as MODULES
    assert set(MODULES) == set(FAMILIES)
    for model_type, module in MODULES.items():
        assert protocol_breaches(module) == [], module.__name__
        assert module.MODEL_TYPE == model_type


def test_a_module_missing_a_hook_or_getting_one_wrong_is_caught():
    import types

    from klotski.models import mixtral
    constants, functions = _protocol()
    hooks = {n: vars(mixtral)[n] for n in [*constants, *functions]}
    assert protocol_breaches(types.SimpleNamespace(**hooks)) == []
    for name in hooks:
        assert protocol_breaches(types.SimpleNamespace(**{n: h for n, h in hooks.items() if n != name})) == \
            [f"{name} missing"]
    wrong = {"HOST_ATTENTION": "yes", "QUANTIZATION": ["mxfp4"], "route": lambda x, gate: None,
             "attention_block": lambda h, w, cos, sin, mask, cache_write, spec, max_scores=None: h,
             "expert_ffn": lambda x, w, prefix: x, "check_config": None}
    for name, value in wrong.items():
        (breach,) = protocol_breaches(types.SimpleNamespace(**{**hooks, name: value}))
        assert breach.startswith(name)


def test_qwen3_5_router_renormalises_whatever_the_config_says(family_models, tmp_path):
    """transformers' Qwen3.5-MoE router always renormalises its top-k: a config with
    norm_topk_prob false still does (Qwen3-Next's honours the field)."""
    path = _copy_with_config(family_models["qwen3_5_moe_text"], tmp_path / "q35", norm_topk_prob=False)
    ours, _ = engine_tokens(path, prompts=PROMPTS[:2], max_new_tokens=6)
    assert ours == reference_tokens(path, prompts=PROMPTS[:2], max_new_tokens=6)


def test_a_hybrid_serves_through_the_openai_client(family_models, tmp_path):
    """`klotski serve` over Qwen3-Next (recurrent state beside KV): two prompts, two samples each
    at temperature 0, with logprobs, through the official client: every answer is transformers'
    greedy one (the samples share their prompt's state)."""
    from transformers import AutoTokenizer
    from test_serve import KEY, Server
    path = family_models["qwen3_next"]
    server = Server(path, tmp_path / "data", "--api-key", KEY, "--dtype", "float32")
    try:
        got = server.client().completions.create(model=str(path), prompt=PROMPTS[:2], max_tokens=6, n=2,
                                                 temperature=0, logprobs=1)
    finally:
        assert server.stop() in (0, 143), server.log.read_text()
    tok = AutoTokenizer.from_pretrained(path)
    want = [tok.decode(ids) for ids in reference_tokens(path, prompts=PROMPTS[:2], max_new_tokens=6)]
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [want[0], want[0], want[1], want[1]]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) > 0 for c in got.choices)
