"""StreamingLLM-style KV sparsity: exact when nothing is dropped, and a real truncation otherwise."""
import pytest
import torch

from conftest import engine_tokens, reference_tokens
from klotski.execute.kvcache import BatchKV
from klotski.models.layers import attention_mask
from placement.placement import Placement


def test_sink_plus_window_covering_the_sequence_is_exact(checkpoints):
    ref = reference_tokens(checkpoints["gqa"])
    _, probe = engine_tokens(checkpoints["gqa"], prompts=["x"], max_new_tokens=1)
    host_kv = Placement.by_kind(probe.spec.group_keys(), kv="host")
    for placement in (None, host_kv):
        ours, _ = engine_tokens(checkpoints["gqa"], placement=placement, attention="sink:4,window:200",
                                batch_size=3, num_batches=2)
        assert ours == ref


def test_truncated_cache_gives_the_same_tokens_on_device_and_host(checkpoints):
    """Sparse output differs from full attention but not between gathering (host) and masking (device)."""
    _, probe = engine_tokens(checkpoints["gqa"], prompts=["x"], max_new_tokens=1)
    host_kv = Placement.by_kind(probe.spec.group_keys(), kv="host")
    dev, _ = engine_tokens(checkpoints["gqa"], attention="sink:2,window:5", batch_size=3, num_batches=2,
                           max_new_tokens=14)
    host, engine = engine_tokens(checkpoints["gqa"], placement=host_kv, attention="sink:2,window:5",
                                 batch_size=3, num_batches=2, max_new_tokens=14)
    full, _ = engine_tokens(checkpoints["gqa"], batch_size=3, num_batches=2, max_new_tokens=14)
    assert dev == host
    assert dev != full


def test_mask_keeps_first_sink_and_last_window_of_each_sequence():
    valid = torch.tensor([[False, False, True, True, True, True, True, True],
                          [True, True, True, True, True, True, True, True]])
    mask = attention_mask(valid, 1, None, sink=1, recent=2)[:, 0, 0]  # the last query, slot 7
    assert mask[0].tolist() == [False, False, True, False, False, False, True, True]
    assert mask[1].tolist() == [True, False, False, False, False, False, True, True]


def test_host_loads_only_the_kept_slots():
    kv = BatchKV(1, 1, 1, 2, 64, torch.float32, on_host=True)
    kv.begin_step(torch.ones(1, 40, dtype=torch.bool), sink=3, recent=8)
    kv.end_step()
    kv.begin_step(torch.ones(1, 1, dtype=torch.bool), sink=3, recent=8)
    assert kv.old_slots.tolist() == [0, 1, 2] + list(range(33, 40))  # 3 sinks + the 7 old in the window
    assert kv.prefix_nbytes() == 2 * 10 * 2 * 4
    keys, values, offset = kv.load(0, "cpu")
    assert offset == 10 and keys.shape[0] == 11  # slot-major: the kept slots and this step's


def test_query_chunking_bounds_scores_and_keeps_results():
    """A long prefill attends in query chunks (bounded score memory); rows agree to float rounding."""
    from types import SimpleNamespace

    from klotski.models import layers as M
    from klotski.models.mixtral import attention_block
    torch.manual_seed(0)
    spec = SimpleNamespace(rms_norm_eps=1e-5, shape=SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16))
    H = 64
    w = {"input_norm": torch.ones(H), "q": torch.randn(64, H) / 8, "k": torch.randn(32, H) / 8,
         "v": torch.randn(32, H) / 8, "o": torch.randn(H, 64) / 8}
    h = torch.randn(2, 50, H)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    cos, sin = M.rope_tables(torch.arange(50).expand(2, 50), inv_freq, 1.0, h.dtype)
    mask = M.attention_mask(torch.ones(2, 50, dtype=torch.bool), 50, None)
    whole = attention_block(h, w, cos, sin, mask, lambda k, v: (k, v), spec)
    chunked = attention_block(h, w, cos, sin, mask, lambda k, v: (k, v), spec, max_scores=2 * 4 * 50 * 7)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cache_scores", [4 * 50 * 50 * 2, 4 * 50 * 7])  # two rows a block; one row, 7 queries
def test_cpu_score_blocks_cover_every_row_and_query(monkeypatch, cache_scores):
    """On a CPU the scores are computed in cache-sized blocks of rows (and of queries, when one
    row is too many); every row's padding, window and causal mask stays its own."""
    from klotski.models import layers as M
    torch.manual_seed(0)
    B, T, heads, kv_heads, D = 5, 50, 4, 2, 16
    q, keys, values = torch.randn(B, heads, T, D), torch.randn(B, kv_heads, T, D), torch.randn(B, kv_heads, T, D)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :20] = valid[4, :35] = False  # left padding differs by row
    mask = M.attention_mask(valid, T, 16)
    whole = M.attend(q, keys, values, mask)
    calls = []

    def attend(*args):
        calls.append(args[0].shape[:3])
        return M.attend(*args)
    monkeypatch.setattr(M, "CACHE_SCORES", cache_scores)
    rows, step = M.score_blocks(B, heads, T, T, None, cpu=True)
    assert (rows, step) == ((2, T) if cache_scores == 4 * 50 * 50 * 2 else (1, 7))
    torch.testing.assert_close(M.in_blocks(attend, q, keys, values, mask, None), whole, atol=1e-6, rtol=1e-6)
    assert len(calls) == -(-B // rows) * -(-T // step) and all(b * h * t * T <= cache_scores for b, h, t in calls)
    assert M.score_blocks(B, heads, T, T, None, cpu=False) == (B, T)  # a GPU keeps the batch whole
