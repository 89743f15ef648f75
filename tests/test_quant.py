"""HQQ quantization: error bounds, byte counts, group and checkpoint round trips.

Error thresholds come from uniform quantization of a normal matrix: a group of 64 spans
about ±2.4σ, so 16 levels give a step Δ ≈ 0.32σ and an rms error Δ/√12 ≈ 0.09σ, i.e. a
relative error ‖W−Ŵ‖/‖W‖ ≈ 0.09 (measured 0.0898 on 1024×3584). The tests allow 0.10 above
and require 0.07 below (a quantizer that silently kept full precision would pass an upper
bound alone). 8-bit measures 0.0055, so "8-bit < 4-bit / 10" has a 1.6x margin.
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from klotski.compress.hqq import (MANIFEST_FILE, WEIGHTS_FILE, QuantSpec, dequantize_group, dequantize_tensor,
                           load_quantized, manifest_matches, packed_nbytes, packed_weight_nbytes, quantize_checkpoint,
                           quantize_group, quantize_tensor, read_manifest, should_quantize)

H, I = 256, 768  # the `small` preset's hidden and intermediate sizes


def normal(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.02).to(dtype)


def rel_error(w, w_hat):
    return ((w.float() - w_hat.float()).norm() / w.float().norm()).item()


def expert(seed=0):
    return {"w1": normal(I, H, seed=seed), "w2": normal(H, I, seed=seed + 1), "w3": normal(I, H, seed=seed + 2)}


def attention(seed=0):
    return {"input_norm": 1 + normal(H, seed=seed), "q": normal(H, H, seed=seed + 1),
            "k": normal(64, H, seed=seed + 2), "v": normal(64, H, seed=seed + 3), "o": normal(H, H, seed=seed + 4)}


# ---- one tensor ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(I, H), (H, I), (32, 64), (50, 100), (7, 200)])
def test_4bit_g64_relative_error(shape):
    w = normal(*shape)
    err = rel_error(w, dequantize_tensor(quantize_tensor(w, QuantSpec())))
    assert 0.07 < err < 0.10, err


def test_more_bits_means_less_error():
    w = normal(I, H)
    err = {b: rel_error(w, dequantize_tensor(quantize_tensor(w, QuantSpec(bits=b))))
           for b in (1, 2, 3, 4)}
    err[8] = rel_error(w, dequantize_tensor(quantize_tensor(w, QuantSpec(bits=8, meta_group_size=None))))
    assert err[1] > err[2] > err[3] > err[4] > err[8]
    assert err[8] < err[4] / 10, err


def test_optimize_reaches_hqq_and_does_not_hurt():
    w = normal(128, H)
    plain = rel_error(w, dequantize_tensor(quantize_tensor(w, QuantSpec())))
    opt = rel_error(w, dequantize_tensor(quantize_tensor(w, QuantSpec(optimize=True))))
    assert opt < plain * 0.98, (opt, plain)  # measured 3-4% lower on normal weights


def test_packed_bytes_are_a_quarter_of_bf16_plus_scales():
    w = normal(I, H)
    parts = quantize_tensor(w)
    groups = w.numel() // 64
    # 4-bit codes + an 8-bit scale and zero per 64 weights + fp32 scale/zero of those
    # codes per 128 groups (x2: once for scales, once for zeros); the header is empty.
    expected = w.numel() // 2 + 2 * groups + 2 * 2 * 4 * (groups // 128)
    assert packed_nbytes(parts) == expected == 104_832
    ratio = w.numel() * 2 / packed_nbytes(parts)
    assert ratio == pytest.approx(2 / (0.5 + 2 / 64 + 16 / 8192))  # 3.7509x smaller than bf16
    assert 3.7 < ratio < 4.0


@pytest.mark.parametrize("spec", [QuantSpec(), QuantSpec(bits=8, meta_group_size=None), QuantSpec(bits=3),
                                  QuantSpec(bits=2, group_size=32)])
@pytest.mark.parametrize("shape", [(64, 100), (96, 256), (7, 33), (160, 96)])
def test_packed_size_is_known_before_quantizing(spec, shape):
    """The planner sizes a quantized group before its copy exists; the formula is exact."""
    assert packed_weight_nbytes(*shape, spec) == packed_nbytes(quantize_tensor(normal(*shape), spec))


def test_parts_are_plain_tensors_that_save_move_and_clone():
    w = normal(50, 100)
    parts = quantize_tensor(w)
    assert parts["q"].dtype == torch.uint8
    assert all(isinstance(t, torch.Tensor) for t in parts.values())
    moved = {k: t.to("cpu", copy=True).clone() for k, t in parts.items()}
    assert torch.equal(dequantize_tensor(moved), dequantize_tensor(parts))


def test_safetensors_round_trip_of_parts(tmp_path):
    w = normal(I, H)
    parts = quantize_tensor(w)
    save_file(parts, tmp_path / "p.safetensors")
    back = load_file(tmp_path / "p.safetensors")
    assert back["header"].shape == parts["header"].shape and back["header"].dtype == torch.bfloat16
    assert torch.equal(dequantize_tensor(back), dequantize_tensor(parts))


def test_dtype_shape_and_views():
    w = normal(H, I, dtype=torch.float32)
    parts = quantize_tensor(w.t())  # a non-contiguous view, as a slice of a fused tensor is
    out = dequantize_tensor(parts)
    assert out.shape == (I, H) and out.dtype == torch.float32 and out.is_contiguous()
    assert torch.equal(out, dequantize_tensor(quantize_tensor(w.t().contiguous())))
    assert dequantize_tensor(parts, torch.bfloat16).dtype == torch.bfloat16
    assert rel_error(w.t(), out) < 0.10


def test_rejects_what_it_cannot_quantize():
    with pytest.raises(ValueError):
        quantize_tensor(normal(H), QuantSpec())
    with pytest.raises(ValueError):
        QuantSpec(bits=5)
    with pytest.raises(ValueError):
        QuantSpec(bits=8)  # 8-bit scales/zeros would ruin 8-bit weights


def test_tags():
    assert QuantSpec().tag() == "hqq4-g64-m128"
    assert QuantSpec(optimize=True).tag() == "hqq4-g64-m128-opt"
    assert QuantSpec.from_tag("hqq4") == QuantSpec()
    assert QuantSpec.from_tag("hqq4", optimize=True) == QuantSpec(optimize=True)
    assert QuantSpec.from_tag("hqq8") == QuantSpec(bits=8, meta_group_size=None)
    assert QuantSpec.from_tag("hqq3-g128-m256-opt") == QuantSpec(3, 128, 256, True)
    for spec in (QuantSpec(), QuantSpec(2, 32, 64, True), QuantSpec(bits=8, meta_group_size=None)):
        assert QuantSpec.from_tag(spec.tag()) == spec
    with pytest.raises(ValueError):
        QuantSpec.from_tag("int4")


# ---- groups -------------------------------------------------------------------------------
def test_should_quantize():
    m = normal(8, 8)
    for name in ("q", "k", "v", "o", "w1", "w2", "w3"):
        assert should_quantize(name, m), name
    # group-local names only (every family's tensors reach quantization under them); norms,
    # routers and the shared expert stay in dtype
    for name in ("router", "input_norm", "post_norm", "embed", "lm_head", "norm", "q_norm", "shared_w1",
                 "shared_gate", "model.layers.3.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        assert not should_quantize(name, m), name
    assert not should_quantize("q", normal(8))  # not 2-D
    assert not should_quantize("q", torch.zeros(8, 8, dtype=torch.int32))


@pytest.mark.parametrize("make", [expert, attention])
def test_group_round_trip_keeps_names_dtypes_shapes(make):
    group = make()
    parts = quantize_group(group, QuantSpec())
    assert all(k in group or k.split(".")[0] in group for k in parts)
    back = dequantize_group(parts, torch.bfloat16)
    assert set(back) == set(group)
    for name, t in group.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        if should_quantize(name, t):
            assert 0.07 < rel_error(t, back[name]) < 0.10, name
    raw = sum(t.numel() * t.element_size() for t in group.values())
    assert raw / packed_nbytes(parts) > 3.6


def test_pass_through_is_bit_exact():
    group = {"post_norm": 1 + normal(H), "router": normal(8, H, dtype=torch.float32)}
    parts = quantize_group(group, QuantSpec())
    assert set(parts) == set(group)
    back = dequantize_group(parts, torch.bfloat16)
    for name, t in group.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    attn = attention()
    back = dequantize_group(quantize_group(attn))
    assert torch.equal(back["input_norm"], attn["input_norm"])


# ---- checkpoints --------------------------------------------------------------------------
@pytest.fixture
def source(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    tensors = {f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight": t
               for e in range(2) for w, t in expert(seed=10 * e).items()}
    tensors.update({f"model.layers.0.self_attn.{n}_proj.weight": attention()[n] for n in "qkvo"})
    tensors["model.layers.0.input_layernorm.weight"] = attention()["input_norm"]
    save_file(tensors, src / "model.safetensors")
    (src / "config.json").write_text("{}")
    return src


def groups_of(src):
    t = load_file(src / "model.safetensors")
    for e in range(2):
        yield f"expert.0.{e}", {w: t[f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"]
                                 for w in ("w1", "w2", "w3")}
    attn = {n: t[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkvo"}
    attn["input_norm"] = t["model.layers.0.input_layernorm.weight"]
    yield "attn.0", attn


def test_checkpoint_round_trip(source, tmp_path):
    spec = QuantSpec()
    out = quantize_checkpoint(source, tmp_path / "q", spec, groups_of(source))
    assert out == tmp_path / "q"
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_FILE, WEIGHTS_FILE]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left

    m = json.loads((out / MANIFEST_FILE).read_text())
    assert m["method"] == "hqq" and m["klotski_format"] == 1
    assert (m["bits"], m["group_size"], m["meta_group_size"], m["optimize"]) == (4, 64, 128, False)
    assert m["source"] == str(source.resolve()) and len(m["source_hash"]) == 64 and m["hqq_version"]
    assert m["groups"] == 3 and m["bytes"] == (out / WEIGHTS_FILE).stat().st_size - _header_len(out)

    for label, group in groups_of(source):
        parts = load_quantized(out, label)
        expected = quantize_group(group, spec)
        assert set(parts) == set(expected)
        for k in parts:
            assert parts[k].dtype == expected[k].dtype and torch.equal(parts[k], expected[k]), k
        back = dequantize_group(parts)
        assert set(back) == set(group)
        assert torch.equal(back["w1" if "w1" in group else "q"],
                           dequantize_group(expected)["w1" if "w1" in group else "q"])
    with pytest.raises(KeyError):
        load_quantized(out, "expert.9.9")
    assert manifest_matches(out, source, spec)


def test_checkpoint_is_readable_by_the_engine_store(source, tmp_path):
    from placement.store import TensorStore
    out = quantize_checkpoint(source, tmp_path / "q", QuantSpec(), groups_of(source))
    store = TensorStore(out)
    parts = load_quantized(out, "expert.0.1")
    assert torch.equal(store.read("expert.0.1/w2.q"), parts["w2.q"])
    assert store.entries["expert.0.1/w2.header"].shape == tuple(parts["w2.header"].shape)


def test_manifest_mismatch_detected(source, tmp_path):
    spec = QuantSpec()
    out = quantize_checkpoint(source, tmp_path / "q", spec, groups_of(source))
    assert manifest_matches(out, source, spec)
    for other in (QuantSpec(bits=3), QuantSpec(group_size=128), QuantSpec(meta_group_size=256),
                  QuantSpec(optimize=True), QuantSpec(bits=8, meta_group_size=None)):
        assert not manifest_matches(out, source, other), other

    moved = tmp_path / "moved"
    source.rename(moved)  # the hash is of content, not of the path
    assert manifest_matches(out, moved, spec)
    assert not manifest_matches(out, tmp_path / "nowhere", spec)

    t = load_file(moved / "model.safetensors")
    t["model.layers.0.input_layernorm.weight"] = t["model.layers.0.input_layernorm.weight"].float()
    save_file(t, moved / "model.safetensors")  # a different checkpoint: dtype changed
    assert not manifest_matches(out, moved, spec)


def test_manifest_missing_or_corrupt(source, tmp_path):
    spec = QuantSpec()
    assert not manifest_matches(tmp_path / "absent", source, spec)
    out = quantize_checkpoint(source, tmp_path / "q", spec, groups_of(source))
    (out / MANIFEST_FILE).write_text("{not json")
    assert read_manifest(out) is None and not manifest_matches(out, source, spec)
    out = quantize_checkpoint(source, tmp_path / "q", spec, groups_of(source))
    (out / WEIGHTS_FILE).unlink()
    assert not manifest_matches(out, source, spec)


def test_crash_leaves_old_checkpoint_and_no_half_one(source, tmp_path):
    spec = QuantSpec()
    out = quantize_checkpoint(source, tmp_path / "q", spec, groups_of(source))
    before = (out / WEIGHTS_FILE).read_bytes()

    def dying():
        yield from list(groups_of(source))[:1]
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        quantize_checkpoint(source, out, QuantSpec(bits=3), dying())
    assert (out / WEIGHTS_FILE).read_bytes() == before and manifest_matches(out, source, spec)
    with pytest.raises(RuntimeError):
        quantize_checkpoint(source, tmp_path / "fresh", spec, dying())
    assert not (tmp_path / "fresh").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "src"]

    out = quantize_checkpoint(source, out, QuantSpec(bits=3), groups_of(source))  # replaces
    assert manifest_matches(out, source, QuantSpec(bits=3)) and not manifest_matches(out, source, spec)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "src"]


def _header_len(out: Path) -> int:
    with open(out / WEIGHTS_FILE, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_leftovers_of_killed_runs_are_removed_live_ones_kept(source, tmp_path):
    # util.writes.replacing's names: no pid 999999999; pid 1 lives
    dead, live = tmp_path / ".q.999999999.0a1b2c3d.tmp", tmp_path / ".q.1.0a1b2c3d.old"
    for d in (dead, live):
        d.mkdir()
        (d / WEIGHTS_FILE).write_bytes(b"half")
    quantize_checkpoint(source, tmp_path / "q", QuantSpec(), groups_of(source))
    assert not dead.exists() and live.exists()


class LiveStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """The most bytes of storages made by ops inside it alive at once (each storage counted
    from the op that made it until the last tensor on it is collected)."""

    def __init__(self):
        super().__init__()
        self.refs, self.size, self.live, self.peak = {}, {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key not in self.refs:
                    self.refs[key], self.size[key] = 0, t.untyped_storage().nbytes()
                    self.live += self.size[key]
                    self.peak = max(self.peak, self.live)
                self.refs[key] += 1
                weakref.finalize(t, self._drop, key)
        return out

    def _drop(self, key):
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.size.pop(key)


@pytest.mark.parametrize("spec", [QuantSpec(), QuantSpec(bits=8, meta_group_size=None), QuantSpec(bits=3),
                                  QuantSpec(bits=2, group_size=32)])
@pytest.mark.parametrize("shape,experts", [((96, 256), 1), ((96, 256), 4), ((100, 70), 3), ((256, 96), 6)])
def test_a_decode_holds_no_more_than_its_workspace(spec, shape, experts):
    """The device bytes a decode takes beyond its output, counted storage by storage, stay
    within `workspace_nbytes` (what the WeightCache reserves around a decode and the planner
    counts); stacked decodes (the expert pool's) come within 2x of it, so the bound is no
    guess. (Unreserved, a stacked HQQ decode held 1.3x its output beside it.)"""
    from klotski.compress.hqq import workspace_nbytes
    parts = [quantize_tensor(normal(*shape, seed=i), spec) for i in range(experts)]
    stacked = {k: torch.stack([p[k] for p in parts]) for k in parts[0]}
    dequantize_tensor(stacked, torch.bfloat16)  # hqq's first call sets itself up
    counted = LiveStorages()
    with counted:
        out = dequantize_tensor(stacked, torch.bfloat16)
    held = counted.peak - out.untyped_storage().nbytes()
    bound = workspace_nbytes(*shape, spec.bits, spec.group_size, torch.bfloat16, experts)
    assert 0 < held <= bound
    if experts > 1:
        assert bound <= 2 * held


def test_the_engine_reserves_what_the_planner_counts_for_a_decode(source, tmp_path):
    """The codec's temporaries for a group (read from its stored headers: what the WeightCache
    reserves) equal the checkpoint's figure from shapes alone (what the planner counts)."""
    from klotski.compress.hqq import group_workspace_nbytes, workspace_nbytes
    from klotski.compress.quantized import QuantCodec
    out = quantize_checkpoint(source, tmp_path / "q", QuantSpec(), groups_of(source))
    codec = QuantCodec(out, torch.bfloat16)
    for label, group in groups_of(source):
        key = tuple(int(p) if p.isdigit() else p for p in label.split("."))
        shapes = [tuple(t.shape) for n, t in group.items() if n != "input_norm"]
        expected = max(workspace_nbytes(*s, 4, 64, torch.bfloat16) for s in shapes)
        assert codec.workspace_nbytes(key) == expected > 0
    assert group_workspace_nbytes([], torch.bfloat16) == 0
