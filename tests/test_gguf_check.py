"""`klotski check` on GGUF files: header, extents, block sizes, non-finite block scales."""
import numpy as np
import pytest

pytest.importorskip("gguf")

import gguf_models as gm  # noqa: E402
from klotski.io import check  # noqa: E402


def problems(path):
    return [p for p in check.scan(str(path)) if "tokenizer has" not in p]


@pytest.fixture()
def model(tmp_path):
    return gm.write(tmp_path / "model.gguf", "Q4_K", gm.QWEN3)


def test_clean_file_has_no_problems(model):
    assert problems(model) == []


def test_non_finite_scale_named(model):
    from gguf import GGUFReader
    t = next(t for t in GGUFReader(model).tensors if t.name == "blk.1.ffn_up_exps.weight")
    with open(model, "r+b") as f:
        f.seek(t.data_offset + 144 * 7 + 2)  # dmin of the eighth block
        f.write(np.array([np.nan], dtype=np.float16).tobytes())
    found = problems(model)
    assert len(found) == 1 and "blk.1.ffn_up_exps.weight" in found[0] and "Q4_K blocks with a NaN" in found[0]


def test_nan_in_float_tensor_named(model):
    from gguf import GGUFReader
    t = next(t for t in GGUFReader(model).tensors if t.name == "blk.0.attn_q.weight")
    with open(model, "r+b") as f:
        f.seek(t.data_offset + 40)
        f.write(np.array([np.inf], dtype=np.float32).tobytes())
    found = problems(model)
    assert len(found) == 1 and "blk.0.attn_q.weight" in found[0] and "1 non-finite" in found[0]


def test_truncated_file_one_line(model):
    size = model.stat().st_size
    with open(model, "r+b") as f:
        f.truncate(size - 1000)
    found = problems(model)
    assert len(found) == 1 and str(model) in found[0] and ("truncated" in found[0] or "not a readable" in found[0])


def test_bad_header_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    found = problems(bad)
    assert len(found) == 1 and "not a readable GGUF file" in found[0]


def test_missing_split_named(tmp_path):
    gm.write(tmp_path / "model.gguf", "Q8_0", gm.QWEN3, split_max_tensors=10)
    (tmp_path / "model-00002-of-00003.gguf").unlink()
    found = problems(tmp_path)
    assert len(found) == 1 and "split in 3 files but 2 are here" in found[0]


def test_expert_entries_slice_merged_tensors(model):
    """Each per-expert entry reads its own expert's rows of the merged GGUF tensor."""
    import gguf
    import torch
    from klotski.io import gguf as kg
    store = kg.GgufStore(kg.files(model))
    t = next(t for t in gguf.GGUFReader(model).tensors if t.name == "blk.1.ffn_down_exps.weight")
    want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)  # [E, H, I]
    for e in range(want.shape[0]):
        got = store.read(f"model.layers.1.mlp.experts.{e}.down_proj.weight")
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want[e])))
    assert store.raw_nbytes(f"model.layers.1.mlp.experts.{e}.down_proj.weight") == t.n_bytes // want.shape[0]
    store.close()
