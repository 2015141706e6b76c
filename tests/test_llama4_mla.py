"""deepseek2's multi-head latent attention (ggufpy/mla.py, issue 13, started by the llama4 helper): the absorbed
form llama.cpp computes from its latent cache equals the decompressed per-head form."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ggufpy import mla, ops

H, D, R, DR, DN, DV = 3, 24, 8, 4, 6, 5  # heads, dim, kv_lora_rank, rope dims, nope dims, value dims


def _layer(seed: int, T: int):
    """x (T, D), attn_kv_a_mqa (R + DR, D), attn_q (H*(DN + DR), D), attn_k_b (H, R, DN), attn_v_b (H, DV, R),
    attn_kv_a_norm (R,)."""
    rng = np.random.default_rng(seed)

    def weight(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    x = rng.standard_normal((T, D)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(R)).astype(np.float32)
    return x, weight(R + DR, D), weight(H * (DN + DR), D), weight(H, R, DN), weight(H, DV, R), norm


@pytest.mark.parametrize("start, T", [(0, 10), (7, 3), (9, 1)])
def test_absorbed_attention_equals_the_decompressed_form(start, T):
    x, wkv_a, wq, k_b, v_b, kv_norm = _layer(3, start + T)
    cos, sin = ops.rope_angles(np.arange(start + T), DR, 10000.0)
    cache = mla.latent_cache_rows(x @ wkv_a.T, kv_norm, 1e-6, cos, sin, R)  # (S, R + DR)
    q = (x[start:] @ wq.T).reshape(T, H, DN + DR)
    args = (q, cache, start, k_b, v_b, cos[start:], sin[start:], mla.kq_scale(DN + DR, 1.0, 1.0, 0.0))
    absorbed, naive = mla.attention_absorbed(*args), mla.attention_naive(*args)
    assert absorbed.shape == naive.shape == (T, H * DV)
    np.testing.assert_allclose(absorbed, naive, rtol=1e-4, atol=1e-5)
    if start:  # causal: the last rows of a whole prefill
        q_all = (x @ wq.T).reshape(-1, H, DN + DR)
        whole = mla.attention_absorbed(q_all, cache, 0, k_b, v_b, cos, sin, args[-1])
        np.testing.assert_allclose(absorbed, whole[start:], rtol=1e-5, atol=1e-6)


def test_kq_scale_is_deepseek2s_mscale_squared():
    """1/sqrt(192) with no scaling; DeepSeek-V3's YaRN x40 with yarn_log_multiplier 0.1 (1 after llama.cpp's / 0.1)."""
    assert mla.kq_scale(192, 1.0, 1.0, 0.0) == pytest.approx(1 / math.sqrt(192), rel=1e-7)
    attn = 1 / (1 + 0.1 * math.log(40))  # the attn_factor llama.cpp's context hands the graph for yarn x40
    mscale = attn * (1 + 0.1 * math.log(40)) * (1 + 0.1 * 1.0 * math.log(40))
    assert mla.kq_scale(192, attn, 1 / 40, 1.0) == pytest.approx(mscale**2 / math.sqrt(192), rel=1e-6)
