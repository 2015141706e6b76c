"""The decoder-only transformer forward pass, written top to bottom in data-flow order.

One `Model` serves every registered architecture: what differs is read from `config.arch` (an `ArchSpec`).
The forward pass runs any half-open range of layers, so a model can be split across machines: a range
starting at layer 0 takes token ids, any other takes hidden states; a range ending at the last layer
returns logits, any other returns hidden states. Shape letters are declared in `ops.py`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import ops
from .backend import Backend, linears
from .config import ModelConfig
from .kvcache import ContextLengthError, KVCache
from .numerics import NUMERICS, Numerics
from .weights import LayerWeights, QuantTensor, Weights

DEFAULT_CACHE_CAPACITY = 4096  # positions; a full 8k-128k context is preallocated only when asked for


class Model:
    """A loaded GGUF model (or the shard `layers` of one). Build it with `ggufpy.load`."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        backend: Backend,
        tokenizer=None,
        layers: range | None = None,
        file=None,
        numerics: Numerics = NUMERICS["exact"],
    ):
        self.config = config
        self.numerics = numerics
        # per-token glue a backend may compute faster (numba); the same f32 steps as the NumPy reference
        self.rms_norm = getattr(backend, "rms_norm", ops.rms_norm)
        # reference functions a backend computes compiled, with the same f32 steps (`NumbaBackend.compiled`)
        self.compiled = getattr(backend, "compiled", {})
        # a backend may run a whole decode block in one call, bit-identical to `block` (`NumbaBackend.decode_block`)
        self.decode_block = getattr(backend, "decode_block", None)
        self.weights = weights
        self.backend = backend
        self.tokenizer = tokenizer
        self.layers = layers if layers is not None else range(config.n_layers)
        self.file = file

    # -- public API ---------------------------------------------------------------------------------------
    def new_cache(self, capacity: int | None = None, layers: range | None = None) -> KVCache:
        """An empty KV cache for one sequence over `layers` (default: this model's layers)."""
        cfg = self.config
        capacity = capacity or min(cfg.context_length, DEFAULT_CACHE_CAPACITY)
        if capacity > cfg.context_length:
            raise ContextLengthError(f"capacity {capacity} exceeds the model's context length {cfg.context_length}")
        return KVCache(layers or self.layers, capacity, cfg.n_kv_heads, cfg.head_dim, self.numerics.kv_dtype)

    def forward(
        self,
        x: np.ndarray,
        pos: int,
        cache: KVCache,
        layers: range | None = None,
        last_only: bool = False,
        trace: dict[str, np.ndarray] | None = None,
    ) -> np.ndarray:
        """Run `layers` (default: all of this model's layers) on x at positions pos..pos+T-1.

        x: token ids (T,) when layers start at 0, else hidden states (T, D). Returns logits (T, V) when
        layers end at the last layer (only the last row when `last_only`), else hidden states (T, D).
        `trace`, when given, receives intermediate tensors under llama.cpp's names (`l_out-N`...).
        """
        cfg = self.config
        if self.file is not None:  # a mapped file truncated since load would SIGBUS on the next weight read
            self.file.check()
        layers = self.layers if layers is None else layers
        if layers.step != 1 or layers.start < self.layers.start or layers.stop > self.layers.stop:
            raise ValueError(f"layers {layers} is not a contiguous part of this model's layers {self.layers}")
        if any(i not in cache.layers for i in layers):
            raise ValueError(f"the cache holds layers {cache.layers}, not all of {layers}")

        if layers.start == 0:
            h = self.embed(np.asarray(x))  # (T, D)
        else:
            h = np.asarray(x, dtype=np.float32)
            if h.ndim != 2 or h.shape[1] != cfg.dim:
                raise ValueError(f"hidden states must have shape (T, {cfg.dim}), got {h.shape}")
        T = h.shape[0]
        if pos + T > cfg.context_length:
            raise ContextLengthError(
                f"positions up to {pos + T} exceed the model's context length {cfg.context_length}"
            )
        cache.check(pos, T)

        positions = np.arange(pos, pos + T)
        angles = {}  # (theta, freq_scale) -> (cos, sin), each (T, R/2): local and global layers may differ
        for i in layers:
            rope = cfg.rope(i)
            if rope not in angles:
                angles[rope] = self.numerics.rope_angles(positions, cfg.rope_dim, *rope, self.weights.rope_freqs)
            out = None
            # (only with the numerics the backend was built for: a record swapped on the model is obeyed)
            if self.decode_block is not None and T == 1 and trace is None and self.numerics is self.backend.numerics:
                out = self.decode_block(cfg, self.weights.layers[i], i, h, pos, *angles[rope], cache)
            h = self.block(h, i, pos, *angles[rope], cache, trace) if out is None else out
        cache.advance(pos + T)

        if layers.stop < cfg.n_layers:
            return h
        if last_only:
            h = h[-1:]
        h = self.rms_norm(h, self.weights.output_norm, cfg.norm_eps)
        _record(trace, "result_norm", h)
        logits = self.backend.linear(h, self.weights.output)  # (T, V)
        if cfg.final_softcap:
            logits = self.numerics.softcap(logits, cfg.final_softcap)
        _record(trace, "result_output", logits)
        return logits

    def decode_batch(self, tokens, positions, caches: list[KVCache]) -> np.ndarray:
        """One decode step of B independent sequences: token `tokens[b]` at position `positions[b]` of the
        sequence held by `caches[b]`. Returns logits (B, V).

        The products run once over the stacked (B, D) rows (each weight read once for all of them), RoPE
        rotates each row at its own position, attention reads each sequence's own cache. Row b is bit for bit
        `forward(tokens[b:b+1], positions[b], caches[b])`, whatever else is in the batch (batch invariance):
        every product is computed per row in the single-row kernel's order (`linears_rows`), and the steps that
        are not elementwise in IEEE arithmetic (norms, attention, activations) are called row by row exactly
        as a one-token forward pass calls them. Needs the model's whole layer range (token ids in, logits out).
        """
        cfg = self.config
        ids = np.asarray(tokens)
        positions = [int(p) for p in positions]
        if ids.ndim != 1 or not len(ids) == len(positions) == len(caches):
            raise ValueError(
                f"decode_batch takes B token ids, B positions and B caches, got {ids.shape}, "
                f"{len(positions)} and {len(caches)}"
            )
        if self.layers != range(cfg.n_layers):
            raise ValueError(f"decode_batch runs the whole model; this one holds layers {self.layers}")
        if self.file is not None:  # as in `forward`: a changed mapped file raises instead of faulting
            self.file.check()
        if len(set(map(id, caches))) != len(caches):
            raise ValueError("decode_batch needs one cache per sequence; a cache appears twice")
        for pos, cache in zip(positions, caches, strict=True):
            if pos + 1 > cfg.context_length:
                raise ContextLengthError(f"position {pos} is past the model's context length {cfg.context_length}")
            if any(i not in cache.layers for i in self.layers):
                raise ValueError(f"the cache holds layers {cache.layers}, not all of {self.layers}")
            cache.check(pos, 1)

        h = self.embed(ids)  # (B, D)
        angles = {}  # (theta, freq_scale) -> (cos, sin), each (B, R/2): row b at positions[b]
        for i in self.layers:
            rope = cfg.rope(i)
            if rope not in angles:  # each row's angles computed as a one-token forward pass computes them
                rows = [
                    self.numerics.rope_angles(np.arange(p, p + 1), cfg.rope_dim, *rope, self.weights.rope_freqs)
                    for p in positions
                ]
                angles[rope] = tuple(np.concatenate(part) for part in zip(*rows, strict=True))
            h = self.block_rows(h, i, positions, *angles[rope], caches)
        for pos, cache in zip(positions, caches, strict=True):
            cache.advance(pos + 1)

        h = self.rms_norm(h, self.weights.output_norm, cfg.norm_eps)
        (logits,) = linears_rows(self.backend, h, (self.weights.output,))  # (B, V)
        if cfg.final_softcap:
            logits = _per_row(lambda x: self.numerics.softcap(x, cfg.final_softcap), logits)
        return logits

    def logits(self, tokens) -> np.ndarray:
        """Logits (T, V) at every position of a fresh sequence of token ids."""
        tokens = np.asarray(tokens, dtype=np.int64)
        cache = self.new_cache(capacity=max(len(tokens), 1))
        return self.forward(tokens, 0, cache)

    # -- the pieces ---------------------------------------------------------------------------------------
    def embed(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"the first layer takes a 1-D array of token ids, got {ids.dtype} {ids.shape}")
        h = self.weights.token_embd.rows(ids)  # (T, D)
        if self.config.arch.embed_scale:
            h = h * np.float32(np.sqrt(self.config.dim))
        return h

    def block(self, h, i: int, pos: int, cos, sin, cache: KVCache, trace=None) -> np.ndarray:
        """One pre-norm transformer block: h + attention(norm(h)), then + feed_forward(norm(.)).

        Optional steps, per ArchSpec: Q/K/V biases, per-head Q/K norms, norms on each branch's output.
        """
        cfg, w, lin = self.config, self.weights.layers[i], self.backend.linear
        T = h.shape[0]

        x = self.rms_norm(h, w.attn_norm, cfg.norm_eps)
        _record(trace, f"attn_norm-{i}", x)
        q, k, v = linears(self.backend, x, (w.attn_q, w.attn_k, w.attn_v))  # (T, Q), (T, K), (T, K)
        if w.attn_q_bias is not None:
            q, k, v = q + w.attn_q_bias, k + w.attn_k_bias, v + w.attn_v_bias
        q = q.reshape(T, cfg.n_heads, cfg.head_dim)  # (T, H, E)
        k = k.reshape(T, cfg.n_kv_heads, cfg.head_dim)  # (T, G, E)
        v = v.reshape(T, cfg.n_kv_heads, cfg.head_dim)  # (T, G, E)
        if w.attn_q_norm is not None:
            q = self.rms_norm(q, w.attn_q_norm, cfg.norm_eps)
            k = self.rms_norm(k, w.attn_k_norm, cfg.norm_eps)
        rope = self.compiled.get(self.numerics.rope, self.numerics.rope)
        q = rope(q, cos, sin, cfg.arch.rope_style)
        k = rope(k, cos, sin, cfg.arch.rope_style)
        _record(trace, f"Qcur-{i}", q)
        _record(trace, f"Kcur-{i}", k)
        _record(trace, f"Vcur-{i}", v)
        keys, values = cache.update(i, pos, k, v)  # (S, G, E) each
        extra = {}  # only architectures that need them pass these, so numerics modes may ignore them otherwise
        if cfg.window(i) is not None:
            extra["window"] = cfg.window(i)
        if cfg.attn_softcap:
            extra["softcap"] = cfg.attn_softcap
        scale = np.float32(1.0) / np.sqrt(np.float32(cfg.head_dim))  # 1.0f/sqrtf(E) (llama-graph.cpp)
        if cfg.arch.scale_q:  # gemma: Q scaled in f32 before the KQ product (and its f16 rounding in llamacpp)
            q, scale = q * (np.float32(1.0) / np.sqrt(np.float32(cfg.head_dim))), 1.0  # 1.0f / sqrtf(E)
        # a backend may compute attention itself (numba); it defers to the numerics mode where that is not exact
        attention = getattr(self.backend, "attention", None) or self.numerics.attention
        attn = attention(q, keys, values, pos, scale, **extra)  # (T, H*E)
        _record(trace, f"kqv_out-{i}", attn)
        out = lin(attn, w.attn_output)  # (T, D)
        if w.post_attention_norm is not None:
            out = self.rms_norm(out, w.post_attention_norm, cfg.norm_eps)
        h = h + out
        _record(trace, f"ffn_inp-{i}", h)

        x = self.rms_norm(h, w.ffn_norm, cfg.norm_eps)
        _record(trace, f"ffn_norm-{i}", x)
        ffn = self.feed_forward(x, w)
        _record(trace, f"ffn_out-{i}", ffn)
        if w.post_ffw_norm is not None:
            ffn = self.rms_norm(ffn, w.post_ffw_norm, cfg.norm_eps)
        h = h + ffn
        _record(trace, f"l_out-{i}", h)
        return h

    def block_rows(self, h, i: int, positions: list[int], cos, sin, caches: list[KVCache]) -> np.ndarray:
        """`block` for B sequences of one token each (`decode_batch`): h (B, D), row b at positions[b] of
        caches[b], with cos, sin (B, R/2). Row b equals `block(h[b:b+1], i, positions[b], ...)` bit for bit."""
        cfg, w = self.config, self.weights.layers[i]
        B = h.shape[0]

        x = self.rms_norm(h, w.attn_norm, cfg.norm_eps)  # each row reduced on its own (tests/test_batch.py)
        q, k, v = linears_rows(self.backend, x, (w.attn_q, w.attn_k, w.attn_v))  # (B, Q), (B, K), (B, K)
        if w.attn_q_bias is not None:
            q, k, v = q + w.attn_q_bias, k + w.attn_k_bias, v + w.attn_v_bias
        q = q.reshape(B, cfg.n_heads, cfg.head_dim)  # (B, H, E)
        k = k.reshape(B, cfg.n_kv_heads, cfg.head_dim)  # (B, G, E)
        v = v.reshape(B, cfg.n_kv_heads, cfg.head_dim)  # (B, G, E)
        if w.attn_q_norm is not None:
            q = self.rms_norm(q, w.attn_q_norm, cfg.norm_eps)
            k = self.rms_norm(k, w.attn_k_norm, cfg.norm_eps)
        rope = self.compiled.get(self.numerics.rope, self.numerics.rope)
        q = rope(q, cos, sin, cfg.arch.rope_style)  # row b rotated by its own angles cos[b], sin[b]
        k = rope(k, cos, sin, cfg.arch.rope_style)
        extra = {}
        if cfg.window(i) is not None:
            extra["window"] = cfg.window(i)
        if cfg.attn_softcap:
            extra["softcap"] = cfg.attn_softcap
        scale = np.float32(1.0) / np.sqrt(np.float32(cfg.head_dim))  # as in `block`
        if cfg.arch.scale_q:
            q, scale = q * (np.float32(1.0) / np.sqrt(np.float32(cfg.head_dim))), 1.0
        attention = getattr(self.backend, "attention", None) or self.numerics.attention
        attn = np.empty((B, cfg.n_heads * cfg.head_dim), np.float32)  # (B, H*E)
        for b, (pos, cache) in enumerate(zip(positions, caches, strict=True)):  # each against its own cache
            keys, values = cache.update(i, pos, k[b : b + 1], v[b : b + 1])  # (S_b, G, E) each
            attn[b] = attention(q[b : b + 1], keys, values, pos, scale, **extra)[0]
        (out,) = linears_rows(self.backend, attn, (w.attn_output,))  # (B, D)
        if w.post_attention_norm is not None:
            out = self.rms_norm(out, w.post_attention_norm, cfg.norm_eps)
        h = h + out

        x = self.rms_norm(h, w.ffn_norm, cfg.norm_eps)
        act = self.numerics.activations[cfg.arch.activation]
        act = self.compiled.get(act, act)
        gate, up = linears_rows(self.backend, x, (w.ffn_gate, w.ffn_up))  # (B, F) each
        (ffn,) = linears_rows(self.backend, _per_row(act, gate) * up, (w.ffn_down,))  # (B, D)
        if w.post_ffw_norm is not None:
            ffn = self.rms_norm(ffn, w.post_ffw_norm, cfg.norm_eps)
        return h + ffn

    def feed_forward(self, x: np.ndarray, w: LayerWeights) -> np.ndarray:
        """Gated feed-forward: down(act(gate(x)) * up(x))."""
        name = self.config.arch.activation
        act = self.numerics.activations[name]
        act = self.compiled.get(act, act)
        gate, up = linears(self.backend, x, (w.ffn_gate, w.ffn_up))  # (T, F) each
        return self.backend.linear(act(gate) * up, w.ffn_down)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Model({c.arch.name}, dim={c.dim}, n_layers={c.n_layers}, n_heads={c.n_heads}, "
            f"n_kv_heads={c.n_kv_heads}, vocab={c.vocab_size}, layers={self.layers}, backend={self.backend.name})"
        )


def linears_rows(backend: Backend, x: np.ndarray, ws: tuple[QuantTensor, ...]) -> list[np.ndarray]:
    """x (B, in) times each of `ws`, row b bit-identical to `linears(backend, x[b:b+1], ws)`: the backend's
    batched kernels where it has them (`backend.linears_rows`: one pass over each weight for all rows), else
    one call per row (a BLAS product of B rows sums in another order than B products of one row)."""
    many = getattr(backend, "linears_rows", None)
    if many is not None:
        return many(x, ws)
    return [
        np.concatenate(rows) for rows in zip(*(linears(backend, x[b : b + 1], ws) for b in range(len(x))), strict=True)
    ]


def _per_row(f, x: np.ndarray) -> np.ndarray:
    """f applied to each row of x (B, ...) on its own: for steps whose vectorized form might round a row
    differently with other rows beside it (exp, tanh in SIMD and scalar tails)."""
    return np.concatenate([f(x[b : b + 1]) for b in range(x.shape[0])])


def _record(trace: dict[str, Any] | None, name: str, value: np.ndarray) -> None:
    if trace is not None:
        trace[name] = value.copy()
