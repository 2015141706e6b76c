"""The decoder-only transformer forward pass, written top to bottom in data-flow order.

One `Model` serves every registered architecture: what differs is read from `config.arch` (an `ArchSpec`).
The forward pass runs any half-open range of layers, so a model can be split across machines: a range
starting at layer 0 takes token ids, any other takes hidden states; a range ending at the last layer
returns logits, any other returns hidden states. Shape letters are declared in `ops.py`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import gemma4, hybrid, mla, moe, ops
from .backend import Backend, linears
from .config import ModelConfig
from .kvcache import KV_TYPES, ContextLengthError, KVCache, attention_q8
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
        # and a whole block of a batched pass (`NumbaBackend.decode_rows`), bit-identical to `block_rows`
        self.decode_rows = getattr(backend, "decode_rows", None)
        self.weights = weights
        self.backend = backend
        self.tokenizer = tokenizer
        self.layers = layers if layers is not None else range(config.n_layers)
        self.file = file

    # -- public API ---------------------------------------------------------------------------------------
    def new_cache(
        self, capacity: int | None = None, layers: range | None = None, kv_type: str | None = None
    ) -> KVCache:
        """An empty KV cache for one sequence over `layers` (default: this model's layers). `kv_type`: None for
        the numerics' own K/V values (f32 exact, f16 llamacpp), or "q8_0" for Q8_0 blocks (`kvcache.Q8Cache`,
        llama.cpp's `-ctk q8_0 -ctv q8_0`, read as its flash attention reads them)."""
        cfg = self.config
        capacity = capacity or min(cfg.context_length, DEFAULT_CACHE_CAPACITY)
        if capacity > cfg.context_length:
            raise ContextLengthError(f"capacity {capacity} exceeds the model's context length {cfg.context_length}")
        if kv_type is not None:
            if kv_type not in KV_TYPES:
                raise ValueError(f"unknown KV cache type {kv_type!r}; available: {', '.join(KV_TYPES)}")
            if cfg.recurrent is not None or cfg.gemma4 is not None or cfg.value_dim is not None:
                raise ValueError(f"a {kv_type} KV cache is for plain K/V layers, not {cfg.arch.name}'s cache")
            rotation = self.numerics.x86_isa if self.numerics.x86_kernels else "f32"  # as llama.cpp (kvcache.py)
            return KV_TYPES[kv_type](layers or self.layers, capacity, cfg.n_kv_heads, cfg.head_dim, rotation=rotation)
        if cfg.recurrent is not None:  # KV for the attention layers, conv + recurrent states for the DeltaNet ones
            return hybrid.new_state(self, layers or self.layers, capacity)
        if cfg.gemma4 is not None:  # per-layer K/V shapes, none for the shared-KV layers
            return gemma4.Gemma4Cache(cfg, layers or self.layers, capacity, self.numerics.kv_dtype)
        dtype = self.numerics.kv_dtype  # (value_dim: deepseek2's keys-only latent cache, or its wider keys)
        return KVCache(layers or self.layers, capacity, cfg.n_kv_heads, cfg.head_dim, dtype, cfg.value_dim)

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
            if cfg.gemma4 is not None:  # the per-layer embeddings' inputs, from the ids and h
                gemma4.set_per_layer_inputs(self, np.asarray(x), h, [cache])
        else:
            if cfg.gemma4 is not None:
                cache.per_layer = None  # not those of these hidden states' tokens
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
        angles = {}  # RoPE parameters -> (cos, sin), each (T, R/2): local and global layers may differ
        for i in layers:
            cos, sin = self._angles(angles, i, [positions])
            out = None
            # (only with the numerics the backend was built for: a record swapped on the model is obeyed)
            if (
                self.decode_block is not None
                and T == 1
                and trace is None
                and self.numerics is self.backend.numerics
                and cfg.fused_block(i)
            ):
                out = self.decode_block(cfg, self.weights.layers[i], i, h, pos, cos, sin, cache)
            h = self.block(h, i, pos, cos, sin, cache, trace) if out is None else out
        cache.advance(pos + T)

        if layers.stop < cfg.n_layers:
            return h
        if last_only:
            h = h[-1:]
        h = self._pre_norm(h, self.weights.output_norm)
        _record(trace, "result_norm", h)
        logits = self.head(self.backend.linear(h, self.weights.output))  # (T, V)
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
        ids = np.asarray(tokens)
        if ids.ndim != 1 or not len(ids) == len(positions) == len(caches):
            raise ValueError(
                f"decode_batch takes B token ids, B positions and B caches, got {ids.shape}, "
                f"{len(positions)} and {len(caches)}"
            )
        return self.prefill_batch([ids[b : b + 1] for b in range(len(ids))], positions, caches)

    @property
    def rows_prefill(self) -> bool:
        """Whether `prefill_batch` takes chunks of more than one token: every layer's mixer is the plain
        attention (the hybrid, MLA and gemma4 mixers' per-sequence state is fed one row per sequence)."""
        cfg = self.config
        return (
            cfg.gemma4 is None
            and cfg.recurrent is None
            and all(self.weights.layers[i].mixer is None for i in self.layers)
        )

    def prefill_batch(self, chunks, positions, caches: list[KVCache]) -> np.ndarray:
        """One pass over chunks of B sequences: token ids `chunks[b]` (T_b of them) at positions
        `positions[b]`.. of the sequence held by `caches[b]`. Returns the logits (B, V) of each chunk's last token.

        Each of the sum(T_b) rows is computed as `decode_batch` computes a row (`block_rows`: per-row products,
        norms and RoPE angles; attention of a row over its own sequence's positions up to its own), so row t of
        chunk b is bit for bit token t decoded alone after the ones before it: a chunk's KV and logits depend on
        its own sequence only, not on the other chunks nor on how a prompt is cut into chunks. Chunks of more
        than one token need `rows_prefill`; the whole layer range, as `decode_batch`."""
        cfg = self.config
        chunks = [np.asarray(c) for c in chunks]
        positions = [int(p) for p in positions]
        if not len(chunks) == len(positions) == len(caches) or any(c.ndim != 1 or len(c) == 0 for c in chunks):
            raise ValueError(
                f"prefill_batch takes B non-empty 1-D chunks of token ids, B positions and B caches, got "
                f"{[c.shape for c in chunks]}, {len(positions)} and {len(caches)}"
            )
        if any(len(c) > 1 for c in chunks) and not self.rows_prefill:
            raise ValueError(f"{cfg.arch.name}: prefill_batch takes one token per sequence here (see rows_prefill)")
        if self.layers != range(cfg.n_layers):
            raise ValueError(f"a batched pass runs the whole model; this one holds layers {self.layers}")
        if self.file is not None:  # as in `forward`: a changed mapped file raises instead of faulting
            self.file.check()
        if len(set(map(id, caches))) != len(caches):
            raise ValueError("a batched pass needs one cache per sequence; a cache appears twice")
        for pos, chunk, cache in zip(positions, chunks, caches, strict=True):
            if pos + len(chunk) > cfg.context_length:
                raise ContextLengthError(f"position {pos} is past the model's context length {cfg.context_length}")
            if any(i not in cache.layers for i in self.layers):
                raise ValueError(f"the cache holds layers {cache.layers}, not all of {self.layers}")
            cache.check(pos, len(chunk))
        if len(chunks) == 1 and len(chunks[0]) == 1:  # one row: the one-token pass (fused block), bit for bit
            return self.forward(chunks[0], positions[0], caches[0])  # the same (tests/test_batch.py), 10-20% less CPU

        # one (position, cache) per row, a sequence's rows in order: each row's K/V is written before a later
        # row of its sequence reads it, and a row reads its cache's positions 0..its own only
        row_pos = [pos + t for pos, chunk in zip(positions, chunks, strict=True) for t in range(len(chunk))]
        row_caches = [cache for cache, chunk in zip(caches, chunks, strict=True) for _ in chunk]
        ids = np.concatenate(chunks)
        h = self.embed(ids)  # (N, D)
        if cfg.gemma4 is not None:  # (one row per cache: `rows_prefill` is False)
            gemma4.set_per_layer_inputs(self, ids, h, caches)
        angles = {}  # RoPE parameters -> (cos, sin), each (N, R/2): row r at row_pos[r]
        one_each = [np.arange(p, p + 1) for p in row_pos]  # each row's angles as a one-token pass computes them
        for i in self.layers:
            cos, sin = self._angles(angles, i, one_each)
            out = None
            if self.decode_rows is not None and self.numerics is self.backend.numerics:
                out = self.decode_rows(cfg, self.weights.layers[i], i, h, row_pos, cos, sin, row_caches)
            h = self.block_rows(h, i, row_pos, cos, sin, row_caches) if out is None else out
        for pos, chunk, cache in zip(positions, chunks, caches, strict=True):
            cache.advance(pos + len(chunk))

        last = np.cumsum([len(c) for c in chunks]) - 1  # each chunk's last row (norm and head are per row)
        h = self._pre_norm(h[last], self.weights.output_norm)
        (logits,) = linears_rows(self.backend, h, (self.weights.output,))  # (B, V)
        if cfg.logit_factor == 1.0 and not cfg.final_softcap:  # `head` is the identity: no per-row copy (~1 ms)
            return logits
        return _per_row(self.head, logits)

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
        if self.config.embedding_scale:  # granite (llama-graph.cpp `build_inp_embd`)
            h = h * np.float32(self.config.embedding_scale)
        return h

    def head(self, logits: np.ndarray) -> np.ndarray:
        """What follows the output product: granite's and cohere2's logit scales, gemma2's final softcap."""
        cfg = self.config
        if cfg.logit_factor != 1.0:  # ggml_scale: granite's 1.0f / logit_scale, cohere2's logit_scale
            logits = logits * np.float32(cfg.logit_factor)
        if cfg.final_softcap:
            logits = self.numerics.softcap(logits, cfg.final_softcap)
        return logits

    def _angles(self, cache: dict, i: int, positions: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin (N, R/2) of layer i for the rows at `positions` (one array per sequence, computed one by
        one as a forward pass of that sequence alone computes them), memoized in `cache` per RoPE parameters."""
        cfg = self.config
        theta, freq_scale = cfg.rope(i)
        ext = cfg.rope_ext(i)
        dims, freqs = cfg.rope_dims(i), self.weights.rope_freqs if cfg.rope_freqs_on(i) else None
        key = (theta, freq_scale, ext, dims, freqs is None)
        if key not in cache:
            more = {} if ext is None else {"ext": ext}  # (plain RoPE calls any numerics' rope_angles as before)
            angles = self.compiled.get(self.numerics.rope_angles, self.numerics.rope_angles)
            parts = [angles(p, dims, theta, freq_scale, freqs, **more) for p in positions]
            cache[key] = tuple(np.concatenate(part) for part in zip(*parts, strict=True))
        return cache[key]

    # -- the block: h + mixer(norm(h)), then + feed_forward(norm(.)) ----------------------------------------
    # One implementation serves a stretch of T tokens of one sequence (`block`, prefill and decode) and one
    # token each of B sequences (`block_rows`, `decode_batch`): `seqs` lists (position, cache) per sequence,
    # each owning len(h) / len(seqs) consecutive rows, and `rows` makes every product and elementwise step
    # that could round a row differently beside others run per row (batch invariance).

    def block(self, h, i: int, pos: int, cos, sin, cache: KVCache, trace=None) -> np.ndarray:
        """Block `i` on h (T, D) at positions pos..pos+T-1 of the sequence held by `cache`."""
        return self._block(h, i, [(pos, cache)], cos, sin, rows=False, trace=trace)

    def block_rows(self, h, i: int, positions: list[int], cos, sin, caches: list[KVCache]) -> np.ndarray:
        """`block` for B sequences of one token each (`decode_batch`): h (B, D), row b at positions[b] of
        caches[b], with cos, sin (B, R/2). Row b equals `block(h[b:b+1], i, positions[b], ...)` bit for bit."""
        return self._block(h, i, list(zip(positions, caches, strict=True)), cos, sin, rows=True)

    def _block(self, h, i: int, seqs: list[tuple[int, KVCache]], cos, sin, rows: bool, trace=None) -> np.ndarray:
        """A pre-norm block: the mixer (attention) and the feed-forward, each a residual branch with the
        ArchSpec's optional steps (no pre-norms: olmo2; norms on each branch's output: gemma2/3, olmo2; the
        residual scale: granite)."""
        w = self.weights.layers[i]
        x = self._pre_norm(h, w.attn_norm)
        _record(trace, f"attn_norm-{i}", x)
        if w.mixer is not None:  # a layer's own mixer (`MIXERS`): DeltaNet, gated attention, MLA
            mixed = MIXERS[type(w.mixer)](self, x, w, i, seqs, cos, sin, trace)
        elif self.config.arch.mixer == "gemma4":
            mixed = gemma4.attention(self, x, w, i, seqs, cos, sin, rows, trace)
        else:
            mixed = self.attention(x, w, i, seqs, cos, sin, rows, trace)
        if self.config.arch.parallel:  # cohere2: both branches read x; (ffn + h) + mixer, llama.cpp's order
            ffn = self.feed_forward(x, w, rows)
            _record(trace, f"ffn_out-{i}", ffn)
            h = (ffn + h) + mixed
            _record(trace, f"l_out-{i}", h)
            return h
        h = self._residual(h, mixed, w.post_attention_norm)
        _record(trace, f"ffn_inp-{i}", h)
        x = self._pre_norm(h, w.ffn_norm)
        _record(trace, f"ffn_norm-{i}", x)
        ffn = self.feed_forward(x, w, rows)
        if self.config.gemma4 is not None:  # 26B-A4B: routed experts beside the dense MLP, on h
            ffn = gemma4.add_experts(self, ffn, h, w, rows)
        _record(trace, f"ffn_out-{i}", ffn)
        h = self._residual(h, ffn, w.post_ffw_norm)
        if self.config.gemma4 is not None:  # the per-layer embedding's branch, the output scale
            h = gemma4.layer_output(self, h, w, i, seqs, rows)
        _record(trace, f"l_out-{i}", h)
        return h

    def _pre_norm(self, h: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
        """The block's and the head's norm: RMSNorm, or LayerNorm (`arch.norm`); none without a weight. Each
        row is reduced on its own, so it is batch-invariant too (tests/test_batch.py)."""
        if weight is None:
            return h
        if self.config.arch.norm == "layer":
            return self.numerics.layer_norm(h, weight, self.config.norm_eps)
        return self.rms_norm(h, weight, self.config.norm_eps)

    def _residual(self, h: np.ndarray, out: np.ndarray, post_norm: np.ndarray | None) -> np.ndarray:
        """h + out, with the branch output normed (post-norms) and scaled (granite's residual_scale) first."""
        if post_norm is not None:
            out = self.rms_norm(out, post_norm, self.config.norm_eps)
        if self.config.residual_scale:  # ggml_scale
            out = out * np.float32(self.config.residual_scale)
        return h + out

    def attention(self, x, w: LayerWeights, i: int, seqs, cos, sin, rows: bool = False, trace=None) -> np.ndarray:
        """The attention mixer: x (N, D) -> (N, D). Q/K/V (fused or not, with biases), Q/K norms per head or
        over all heads, RoPE (not on NoPE layers), each sequence's rows against its own cache (with gpt-oss's
        sinks in the softmax), the output product (plus its bias: gpt-oss)."""
        cfg, N = self.config, x.shape[0]
        if w.attn_qkv is not None:  # phi3: one product, then views of its columns (llama.cpp `build_qkv`)
            (qkv,) = self._products(x, (w.attn_qkv,), rows)  # (N, Q+2K)
            q, k, v = np.split(qkv, [cfg.q_dim, cfg.q_dim + cfg.kv_dim], axis=1)
        else:
            q, k, v = self._products(x, (w.attn_q, w.attn_k, w.attn_v), rows)  # (N, Q), (N, K), (N, K)
        if w.attn_q_bias is not None:
            q, k, v = q + w.attn_q_bias, k + w.attn_k_bias, v + w.attn_v_bias
        if w.attn_q_norm is not None and cfg.arch.qk_norm_span == "all":  # olmo2: over the whole Q and K rows
            q = self.rms_norm(q, w.attn_q_norm, cfg.norm_eps)
            k = self.rms_norm(k, w.attn_k_norm, cfg.norm_eps)
        q = q.reshape(N, cfg.n_heads, cfg.head_dim)  # (N, H, E)
        k = k.reshape(N, cfg.n_kv_heads, cfg.head_dim)  # (N, G, E)
        v = v.reshape(N, cfg.n_kv_heads, cfg.head_dim)  # (N, G, E)
        if w.attn_q_norm is not None and cfg.arch.qk_norm_span == "head":
            q = self.rms_norm(q, w.attn_q_norm, cfg.norm_eps)
            k = self.rms_norm(k, w.attn_k_norm, cfg.norm_eps)
        if cfg.uses_rope(i):
            rope = self.compiled.get(self.numerics.rope, self.numerics.rope)
            q = rope(q, cos, sin, cfg.arch.rope_style)  # row r rotated by its own angles cos[r], sin[r]
            k = rope(k, cos, sin, cfg.arch.rope_style)
        _record(trace, f"Qcur-{i}", q)
        _record(trace, f"Kcur-{i}", k)
        _record(trace, f"Vcur-{i}", v)
        if cfg.qk_l2_norm and cfg.uses_rope(i):  # llama4: ggml_rms_norm of each head, no weight (x 1 is exact)
            ones = np.ones(cfg.head_dim, np.float32)
            q, k = self.rms_norm(q, ones, cfg.norm_eps), self.rms_norm(k, ones, cfg.norm_eps)
        if cfg.temperature_on(i):  # temperature tuning (mistral3, llama4): ggml_mul(Qcur, attn_scale), per position
            n = N // len(seqs)
            positions = np.concatenate([np.arange(pos, pos + n) for pos, _ in seqs])  # (N,)
            q = q * cfg.attn_temperature(positions)[:, None, None]
        extra = {}  # only architectures that need them pass these, so numerics modes may ignore them otherwise
        if cfg.window(i) is not None:
            extra["window"] = cfg.window(i)
        if cfg.attn_softcap:
            extra["softcap"] = cfg.attn_softcap
        # 1.0f/sqrtf(E) (llama-graph.cpp), or granite's attention.scale
        scale = np.float32(cfg.attention_scale or np.float32(1.0) / np.sqrt(np.float32(cfg.head_dim)))
        if cfg.arch.scale_q:  # gemma, phi3: Q scaled in f32 before the KQ product (and its f16 rounding in llamacpp)
            q, scale = q * (np.float32(1.0) / np.sqrt(np.float32(cfg.head_dim))), 1.0  # 1.0f / sqrtf(E)
        # a backend may compute attention itself (numba); it defers to the numerics mode where that is not exact
        # (sinks, gpt-oss: compiled in the llamacpp numerics, the numerics' own function in the exact ones)
        attention = getattr(self.backend, "attention", None) or self.numerics.attention
        if w.attn_sinks is not None:
            extra["sinks"] = w.attn_sinks
        n = N // len(seqs)  # rows per sequence: T for `block`, 1 for `block_rows`
        attn = np.empty((N, cfg.n_heads * cfg.head_dim), np.float32)  # (N, H*E)
        plain = (
            w.attn_sinks is None and cfg.chunk(i) is None and all(getattr(c, "kv_type", None) is None for _, c in seqs)
        )
        together = rows and plain and _attention_rows(self.backend, q, k, v, i, seqs, scale, extra, attn)
        for s, (pos, cache) in enumerate(() if together else seqs):
            r = slice(s * n, (s + 1) * n)
            keys, values = cache.update(i, pos, k[r], v[r])  # (S, G, E) each, or (S, G, E/32*34) Q8_0 rows
            quantized = getattr(cache, "kv_type", None) is not None  # Q8_0 K/V blocks: flash attention over them
            attend = attention_q8(self.numerics, self.backend, cache) if quantized else attention
            if cfg.chunk(i) is None:
                attn[r] = attend(q[r], keys, values, pos, scale, **extra)
            else:
                attn[r] = _chunked(attend, q[r], keys, values, pos, scale, cfg.chunk(i), extra)
        _record(trace, f"kqv_out-{i}", attn)
        (out,) = self._products(attn, (w.attn_output,), rows)  # (N, D)
        if w.attn_output_bias is not None:  # gpt-oss: build_attn's ggml_add(cur, wo_b)
            out = out + w.attn_output_bias
        return out

    def feed_forward(self, x: np.ndarray, w: LayerWeights, rows: bool = False) -> np.ndarray:
        """The feed-forward of block `w`: x (N, D) -> (N, D). Gated: down(act(gate(x)) * up(x)), gate and up
        from one fused ffn_up where the ArchSpec says so (phi3). `rows`: batch-invariant, per row."""
        act = self.numerics.activations[self.config.arch.activation]
        act = self.compiled.get(act, act)
        if w.ffn_gate_inp is not None:  # a mixture of experts (`ggufpy.moe`), per row where batch-invariant
            cfg = self.config
            k, be, nm = cfg.n_experts_used, self.backend, self.numerics

            def experts(xs: np.ndarray) -> np.ndarray:
                return moe.feed_forward(xs, w, cfg.routing, k, be, nm, act)

            return _per_row(experts, x) if rows else experts(x)
        if w.ffn_gate is None:  # ffn_up (2F, D): gate rows first (ggml_swiglu's first half)
            (gate_up,) = self._products(x, (w.ffn_up,), rows)  # (N, 2F)
            gate, up = np.split(gate_up, 2, axis=1)  # (N, F) each
        else:
            gate, up = self._products(x, (w.ffn_gate, w.ffn_up), rows)  # (N, F) each
        # per row unless the backend computes `act` alike in its SIMD body and scalar tail (`row_invariant`)
        invariant = act in getattr(self.backend, "row_invariant", ())
        gated = _per_row(act, gate) if rows and not invariant else act(gate)
        (out,) = self._products(gated * up, (w.ffn_down,), rows)
        return out  # (N, D)

    def _products(self, x: np.ndarray, ws: tuple[QuantTensor, ...], rows: bool) -> list[np.ndarray]:
        """x times each of `ws`; with `rows`, each row in the single-row kernels' order (`linears_rows`)."""
        if rows:
            return linears_rows(self.backend, x, ws)
        return [self.backend.linear(x, ws[0])] if len(ws) == 1 else linears(self.backend, x, ws)

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


def _attention_rows(backend: Backend, q, k, v, i: int, seqs, scale, extra: dict, out: np.ndarray) -> bool:
    """Batched decode (one row per sequence): every row's attention in one call into `out` where the backend
    has one (`attention_rows`: each row bit for bit its own call); False: the caller goes row by row.
    q (B, H, E), k and v (B, G, E)."""
    together = getattr(backend, "attention_rows", None)
    if together is None:
        return False
    kv = [cache.update(i, pos, k[s : s + 1], v[s : s + 1]) for s, (pos, cache) in enumerate(seqs)]
    attn = together(q, kv, scale, **extra)
    if attn is not None:
        out[:] = attn
    return attn is not None


def _chunked(attention, q, keys, values, pos: int, scale, chunk: int, extra: dict) -> np.ndarray:
    """Attention of a chunked layer (llama4) for q (T, H, E) at pos..pos+T-1: the rows of each chunk of positions
    see only that chunk's keys (llama-hparams.h `is_masked_swa`, LLAMA_SWA_TYPE_CHUNKED: key p0 is masked for
    query p1 when p0 < (p1 / n_swa) * n_swa). Within the first chunk this is the plain call."""
    out, p, end_all = [], pos, pos + len(q)
    while p < end_all:
        start = p // chunk * chunk
        end = min(end_all, start + chunk)
        rows = slice(p - pos, end - pos)
        out.append(attention(q[rows], keys[start:end], values[start:end], p - start, scale, **extra))
        p = end
    return np.concatenate(out)


def _per_row(f, x: np.ndarray) -> np.ndarray:
    """f applied to each row of x (B, ...) on its own: for steps whose vectorized form might round a row
    differently with other rows beside it (exp, tanh in SIMD and scalar tails)."""
    return np.concatenate([f(x[b : b + 1]) for b in range(x.shape[0])])


# `LayerWeights.mixer`'s type -> the mixer, with `hybrid.mixer`'s arguments: the hybrid models' (DeltaNet, gated
# attention), deepseek2's multi-head latent attention
MIXERS = {**dict.fromkeys(hybrid.MIXERS, hybrid.mixer), mla.MLAWeights: mla.mixer}


def _record(trace: dict[str, Any] | None, name: str, value: np.ndarray) -> None:
    if trace is not None:
        trace[name] = value.copy()
