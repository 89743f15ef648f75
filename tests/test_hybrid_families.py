"""The linear-attention hybrids' parts (Qwen3-Next, Qwen3.5/3.6-MoE: Gated DeltaNet layers with
a recurrent state per sequence): the DeltaNet math against transformers' own torch functions, a
pad as an identity step, the recurrent-state kind's row operations, the planner's constant
bytes. Their runs through the engine are in tests/test_families.py, beside every family's (it
measures each family's profile once: greedy equality, every schedule under a quarter budget,
continuous refills, a shared instruction, static batching, the host tier, the vision-language
checkpoint, the refusal of sparse attention)."""
import types

import pytest
import torch

from klotski.execute.recurrent import RecurrentState
from klotski.models import gated_deltanet as G


def _inputs(B=2, T=70, Hk=2, Hv=4, Dk=8, Dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(B, T, Hk, Dk), r(B, T, Hk, Dk), r(B, T, Hv, Dv), -torch.rand(B, T, Hv, generator=g),
            torch.rand(B, T, Hv, generator=g), r(B, Hv, Dk, Dv))


@pytest.mark.parametrize("T", [1, 5, 70])
def test_the_delta_rule_is_transformers_torch_path(T):
    """Chunked (T > 1: chunks of 64 and a padded last one) and recurrent (T = 1) forms, from a
    non-zero state, against transformers' torch_chunk/recurrent_gated_delta_rule."""
    from transformers.models.qwen3_next import modeling_qwen3_next as ref
    q, k, v, g, beta, state = _inputs(T=T)
    rule = ref.torch_recurrent_gated_delta_rule if T == 1 else ref.torch_chunk_gated_delta_rule
    want, want_state = rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
    got, got_state = G.delta_rule(q, k, v, g, beta, state, torch.ones(2, T, dtype=torch.bool))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)


def test_the_causal_conv_is_transformers_with_its_state():
    from transformers.models.qwen3_next import modeling_qwen3_next as ref
    x, w = torch.randn(2, 9, 12), torch.randn(12, 1, 4)
    want = ref.causal_conv1d_fn(x.transpose(1, 2), w.squeeze(1), activation="silu").transpose(1, 2)
    out, state = G.causal_conv(x[:, :6], torch.zeros(2, 12, 3), w, torch.ones(2, 6, dtype=torch.bool))
    rest, _ = G.causal_conv(x[:, 6:], state, w, torch.ones(2, 3, dtype=torch.bool))  # resumed from its state
    torch.testing.assert_close(torch.cat([out, rest], dim=1), want)


@pytest.mark.parametrize("T", [1, 6, 70])
def test_a_pad_is_an_identity_step(T):
    """Row 0 left-padded by p tokens beside row 1, from non-zero states: its real tokens' outputs
    and its final conv and matrix states are those of the row alone, unpadded."""
    q, k, v, g, beta, state = _inputs(T=T)
    x, conv, w = torch.randn(2, T, 12), torch.randn(2, 12, 3), torch.randn(12, 1, 4)
    p = T // 2 if T > 1 else 1
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[0, :p] = False
    out, new_state = G.delta_rule(q, k, v, g, beta, state, valid)
    c_out, c_state = G.causal_conv(x, conv, w, valid)
    if p < T:
        alone, alone_state = G.delta_rule(q[:1, p:], k[:1, p:], v[:1, p:], g[:1, p:], beta[:1, p:], state[:1],
                                          valid[:1, p:])
        torch.testing.assert_close(out[:1, p:], alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_state[:1], alone_state, rtol=1e-5, atol=1e-5)
        c_alone, c_alone_state = G.causal_conv(x[:1, p:], conv[:1], w, valid[:1, p:])
        torch.testing.assert_close(c_out[:1, p:], c_alone)
        torch.testing.assert_close(c_state[:1], c_alone_state)
    else:  # nothing but pads: the state is as it was
        torch.testing.assert_close(new_state[:1], state[:1])
        torch.testing.assert_close(c_state[:1], conv[:1])


def test_the_recurrent_kind_moves_rows_and_starts_from_a_segments_end():
    def kind(batch):
        return RecurrentState([0, 2], batch, (6, 3), (2, 4, 4), torch.float32)
    src, dst = kind(3), kind(2)
    for t in (*src.conv.values(), *src.matrix.values()):
        t.copy_(torch.randn_like(t))
    dst.adopt(1, src, 2, length=5)
    for j in (0, 2):
        assert torch.equal(dst.matrix[j][1], src.matrix[j][2]) and torch.equal(dst.conv[j][1], src.conv[j][2])
        assert not dst.matrix[j][0].any()
    segment = types.SimpleNamespace(kv=types.SimpleNamespace(state=src), row=0, length=4)
    dst.mark_prefix([(), (segment,)])
    assert torch.equal(dst.matrix[2][1], src.matrix[2][0]) and not dst.matrix[2][0].any()
    dst.scrub(1)
    assert not dst.matrix[0][1].any() and not dst.conv[2][1].any()
    dst.adopt(0, src, 1, 1)
    dst.reset(1)
    assert dst.rows == 1 and not any(t.any() for t in dst.matrix.values())
    assert RecurrentState.nbytes_for(2, 3, (6, 3), (2, 4, 4), torch.float32) == 2 * 3 * (18 * 4 + 32 * 4)


def test_the_planner_counts_the_state_as_a_constant_per_sequence():
    """The hybrids' KV bytes per token are their full-attention layers' only; the recurrent state
    is bytes per sequence (conv + fp32 matrix per linear layer), whatever the length."""
    from planner.shapes import KNOWN_MODELS
    shape = KNOWN_MODELS["qwen3-next-80b-a3b"]
    assert len(shape.linear_layers) == 36 and shape.attention_layers == 12
    assert shape.kv_bytes_per_token() == 12 * 2 * 2 * 256 * 2
    conv = (2 * 16 * 128 + 32 * 128) * 3 * 2
    assert shape.recurrent_bytes_per_sequence() == 36 * (conv + 32 * 128 * 128 * 4)
