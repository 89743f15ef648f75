"""klotski.builtin.tiny: deterministic checkpoints that transformers loads as real Mixtral."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from klotski.util import cachedir
from klotski.builtin import tiny, tokenizer


def _tensors(d):
    """All tensors of a checkpoint dir, whatever its sharding."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def _load(d):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def _logits(model, n=24):
    ids = torch.arange(3, 3 + n)[None] % model.config.vocab_size
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return tiny.build_checkpoint(tmp_path_factory.mktemp("hub"), "tiny")


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    return tiny.build_checkpoint(tmp_path_factory.mktemp("fused"), "tiny", fused_experts=True)


def test_rebuild_is_byte_identical(hub, tmp_path):
    again = tiny.build_checkpoint(tmp_path / "again", "tiny")
    names = sorted(p.name for p in hub.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (hub / name).read_bytes() == (again / name).read_bytes(), name


def test_seed_changes_weights(hub, tmp_path):
    other = _tensors(tiny.build_checkpoint(tmp_path / "s1", "tiny", seed=1))
    base = _tensors(hub)
    assert not torch.equal(base["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_hub_key_names(hub):
    t = _tensors(hub)
    cfg = json.loads((hub / "config.json").read_text())
    H, I, E = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    assert cfg["model_type"] == "mixtral" and cfg["dtype"] == "float32"
    assert cfg["vocab_size"] == 512 and t["model.embed_tokens.weight"].shape == (512, H)
    assert "lm_head.weight" in t and "model.norm.weight" in t
    p = "model.layers.3."
    assert t[p + "block_sparse_moe.gate.weight"].shape == (E, H)
    assert t[p + f"block_sparse_moe.experts.{E - 1}.w1.weight"].shape == (I, H)
    assert t[p + f"block_sparse_moe.experts.{E - 1}.w2.weight"].shape == (H, I)
    assert t[p + f"block_sparse_moe.experts.{E - 1}.w3.weight"].shape == (I, H)
    assert t[p + "self_attn.k_proj.weight"].shape == (2 * 16, H)  # GQA: 2 kv heads
    assert not any(".mlp." in k for k in t)
    assert len(t) == 1 + 4 * (7 + 3 * E) + 2
    with safe_open(hub / "model.safetensors", "pt") as st:
        assert st.metadata() == {"format": "pt"}


def test_fused_layout_holds_the_same_numbers(hub, fused):
    h, f = _tensors(hub), _tensors(fused)
    p = "model.layers.1."
    gate_up, down = f[p + "mlp.experts.gate_up_proj"], f[p + "mlp.experts.down_proj"]
    for e in (0, 5):
        x = f"{p}block_sparse_moe.experts.{e}."
        assert torch.equal(gate_up[e], torch.cat([h[x + "w1.weight"], h[x + "w3.weight"]]))
        assert torch.equal(down[e], h[x + "w2.weight"])
    assert torch.equal(f[p + "mlp.gate.weight"], h[p + "block_sparse_moe.gate.weight"])
    assert not any("block_sparse_moe" in k for k in f)


def test_both_layouts_load_in_transformers_with_equal_logits(hub, fused):
    outs = []
    for d in (hub, fused):
        model, info = _load(d)
        assert not any(info.values()), info  # no missing/unexpected/mismatched keys
        # the file's values really landed in the model (not a fresh init)
        emb = _tensors(d)["model.embed_tokens.weight"]
        assert torch.equal(model.model.embed_tokens.weight.detach(), emb)
        outs.append(_logits(model))
    # Two layouts are two code paths (fused vs per-expert tensors, different strides), so the
    # kernels may round differently: equal greedy decisions, logits equal to fp32 rounding.
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    # crisp greedy decisions: the top-1/top-2 gap is far above fp32 noise
    top2 = outs[0][0].topk(2, dim=-1).values
    gap = (top2[:, 0] - top2[:, 1]) / top2[:, 0].abs()
    assert gap.median() > 1e-2


def test_sharded_equals_single_file(hub, tmp_path):
    d = tiny.build_checkpoint(tmp_path / "sh", "tiny", num_shards=3)
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert shards == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    single, sharded = _tensors(hub), _tensors(d)
    assert set(index["weight_map"]) == set(single) == set(sharded)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    for k, v in single.items():
        assert torch.equal(v, sharded[k]), k
    # a rebuild into the same dir with one shard leaves no stale shards behind
    tiny.build_checkpoint(d, "tiny")
    assert sorted(p.name for p in d.glob("model*")) == ["model.safetensors"]


def test_variants_and_dtype(tmp_path):
    d = tiny.build_checkpoint(
        tmp_path / "v", "tiny", dtype="bfloat16", num_key_value_heads=1,
        sliding_window=8, num_hidden_layers=2, tie_word_embeddings=True)
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["num_key_value_heads"], cfg["sliding_window"], cfg["num_hidden_layers"]) == (1, 8, 2)
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    t = _tensors(d)
    assert "lm_head.weight" not in t and "model.layers.2.input_layernorm.weight" not in t
    assert all(v.dtype == torch.bfloat16 for v in t.values())
    model, info = _load(d)
    assert not any(info.values()), info
    assert torch.isfinite(_logits(model)).all()
    with pytest.raises(TypeError):
        tiny.build_checkpoint(tmp_path / "bad", "tiny", hiden_size=3)


def test_tokenizer_roundtrip_and_chat_template(hub):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hub)
    cfg = json.loads((hub / "config.json").read_text())
    assert len(tok) == cfg["vocab_size"] == 512
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"])
    for text in ["The Danube flows into the Black Sea.", "  leading spaces\tand\nnewlines ",
                 "Café, naïve, Ísland — 中文 😀 ∑"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.encode("Hello")[0] == tok.bos_token_id
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == tok.bos_token_id and tok.convert_tokens_to_ids("<|assistant|>") in ids


def test_small_preset_tokenizer_size(tmp_path):
    # Only the tokenizer: small's weights are not needed to check the vocabulary.
    from tokenizers import Tokenizer

    assert Tokenizer.from_str(tokenizer.tokenizer_json(2048)).get_vocab_size() == 2048
    assert Tokenizer.from_str(tokenizer.tokenizer_json(4096)).get_vocab_size() == 4096


def test_shard_split_is_balanced_and_non_empty():
    ids = tiny._shard_ids([100, 1, 1, 1, 1, 50, 50], 4)
    assert ids == sorted(ids) and set(ids) == {0, 1, 2, 3}
    with pytest.raises(ValueError):
        tiny._shard_ids([1, 2], 3)


def test_ensure_builtin_builds_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cachedir.root() == tmp_path / "klotski"
    d = tiny.ensure_builtin("tiny-mixtral")
    assert d == tmp_path / "klotski" / "models" / "tiny-mixtral"
    assert "building tiny-mixtral" in capsys.readouterr().err
    assert (d / "config.json").exists() and (d / "model.safetensors").exists()
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_builtin("tiny-mixtral") == d
    assert capsys.readouterr().err == ""
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime
    # nothing half-built is left next to it
    assert sorted(os.listdir(d.parent)) == ["tiny-mixtral"]
    with pytest.raises(ValueError):
        tiny.ensure_builtin("huge-mixtral")


def test_ensure_builtin_rebuilds_stale_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    d = tiny.ensure_builtin("tiny-mixtral")
    stamp = json.loads((d / tiny.STAMP_FILE).read_text())
    stamp["build_version"] = -1
    (d / tiny.STAMP_FILE).write_text(json.dumps(stamp))
    capsys.readouterr()
    assert tiny.ensure_builtin("tiny-mixtral") == d
    assert "out of date" in capsys.readouterr().err
    assert json.loads((d / tiny.STAMP_FILE).read_text())["build_version"] == tiny.BUILD_VERSION
    assert sorted(os.listdir(d.parent)) == ["tiny-mixtral"]


def test_skewed_routing_concentrates_and_correlates_experts(hub, tmp_path):
    def routing_stats(d):
        model, info = _load(d)
        assert not any(info.values()), info
        text = tokenizer.CORPUS.read_text(encoding="utf-8")[:1500]  # < 1024 positions
        ids = torch.tensor([model.config.bos_token_id] + _tok(d).encode(text, add_special_tokens=False))
        with torch.no_grad():
            routers = model(ids[None], output_router_logits=True).router_logits
        top = [r.topk(2, dim=-1).indices for r in routers]
        E = model.config.num_local_experts
        shares = [torch.bincount(t.flatten(), minlength=E).sort(descending=True).values[:2].sum()
                  / t.numel() for t in top]
        # how often layer l's first choice fixes layer l+1's first choice
        agree = []
        for a, b in zip(top, top[1:]):
            pairs = torch.zeros(E, E)
            pairs.index_put_((a[:, 0], b[:, 0]), torch.ones(len(a)), accumulate=True)
            agree.append(pairs.max(1).values.sum() / len(a))
        return sum(shares) / len(shares), sum(agree) / len(agree)

    uniform = routing_stats(hub)
    skewed = routing_stats(tiny.build_checkpoint(tmp_path / "sk", "tiny", routing="skewed"))
    assert uniform[0] < 0.42 < skewed[0] < 0.65, (uniform, skewed)
    assert skewed[1] > uniform[1] + 0.1, (uniform, skewed)


def _tok(d):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(d)
