"""Attention over the KV cache's slot-major views (execute/kvcache.py: [slots, B, kvh, D] read as
[B, kvh, slots, D]): the keys-first product a CPU decode takes in 16 bits (layers.grouped_scores)
gives the scores of q·kᵀ over contiguous keys, and `attend` stays scaled dot-product attention."""
import pytest
import torch
import torch.nn.functional as F

from klotski.models import layers as L


def slot_major(B, kvh, S, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    store = torch.randn(S + 5, B, kvh, D, generator=g).to(dtype)  # room past the filled slots, as a cache has
    return store[:S].permute(1, 2, 0, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T", [1, 3, 40])  # decode, a few queries, past KEYS_FIRST_ROWS per kv head
def test_scores_over_slot_major_keys_are_q_times_k(dtype, T):
    B, heads, kvh, D, S = 5, 6, 2, 16, 23
    keys = slot_major(B, kvh, S, D, dtype, 0)
    assert not keys.is_contiguous()
    q = torch.randn(B, kvh, heads // kvh * T, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = L.grouped_scores(q, keys)
    # the reference: the plain product over a contiguous copy, in fp64
    ref = torch.matmul(q.double(), keys.contiguous().double().transpose(2, 3)) * D ** -0.5
    assert got.shape == (B, kvh, heads // kvh * T, S) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    # a swapped row or head would sit far outside that tolerance: the check can tell
    assert not torch.allclose(got.double(), ref.roll(1, dims=0), rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attend_over_slot_major_cache_is_sdpa(dtype):
    B, heads, kvh, D, S = 4, 6, 2, 16, 19
    keys, values = slot_major(B, kvh, S, D, dtype, 2), slot_major(B, kvh, S, D, dtype, 3)
    q = torch.randn(B, heads, 1, D, generator=torch.Generator().manual_seed(4)).to(dtype)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[1, ..., :7] = False  # left padding of one row
    got = L.attend(q, keys, values, mask)
    rep = heads // kvh
    ref = F.scaled_dot_product_attention(q.double(), keys.double().repeat_interleave(rep, 1),
                                         values.double().repeat_interleave(rep, 1), attn_mask=mask)
    ref = ref.transpose(1, 2).reshape(B, 1, heads * D)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
