"""The state of one sequence in a hybrid model: what each layer kind needs to continue the sequence.

Attention layers keep keys and values per position (a `KVCache` over those layers); DeltaNet layers keep a
fixed-size summary of every position so far, the conv state (the last K-1 inputs of the causal conv) and the
recurrent state (B, S, S) (llama.cpp `src/llama-memory-hybrid.cpp`: a KV cache beside `llama-memory-recurrent`);
lfm2's short-conv layers keep a conv state only (the last L-1 inputs, `ggufpy.shortconv`).
`HybridState` offers the `KVCache` interface the forward pass, generation and the shard engine use (layers,
capacity, length, check, update, advance, truncate, nbytes), over any layer range: a shard's state holds only its
own layers under their global numbers, so running [0, k) then [k, n) equals running the whole model.

A recurrent state cannot go back: it summarizes positions 0..length-1 and cannot forget the last few. So a
sequence continues only at its end (pos == length) or restarts at 0, and `truncate` to a shorter non-zero
length clears the sequence (as llama.cpp's recurrent memory refuses a partial `seq_rm`).
"""

from __future__ import annotations

import numpy as np

from .deltanet import DeltaNetConfig
from .deltanet import empty_state as deltanet_state
from .kvcache import ContextLengthError, KVCache
from .shortconv import ShortConvConfig
from .shortconv import empty_state as shortconv_state

# a recurrent layer's fresh (conv, recurrent) states by the kind of its config: DeltaNet's (K-1, C) and (B, S, S),
# lfm2's short conv (L-1, D) and none
EMPTY_STATES = {DeltaNetConfig: deltanet_state, ShortConvConfig: shortconv_state}


def empty_state(cfg: DeltaNetConfig | ShortConvConfig) -> tuple[np.ndarray, np.ndarray]:
    return EMPTY_STATES[type(cfg)](cfg)


class HybridState:
    """KV for the attention layers of `layers`, conv + recurrent states for the recurrent ones (`cfg.recurrent`)."""

    def __init__(
        self,
        layers: range,
        capacity: int,
        n_kv_heads: int,
        head_dim: int,
        cfg: DeltaNetConfig | ShortConvConfig,
        dtype=np.float32,
    ):
        self.layers = layers
        self.cfg = cfg
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.recurrent_layers = [i for i in layers if cfg.recurrent[i]]
        self.kv = KVCache([i for i in layers if not cfg.recurrent[i]], capacity, n_kv_heads, head_dim, dtype)
        self.conv: dict[int, np.ndarray] = {}  # layer -> (K-1, C); lfm2: (L-1, D)
        self.ssm: dict[int, np.ndarray] = {}  # layer -> (B, S, S); lfm2: (0,)
        # a forward call's new states, kept aside until `advance`: a call that fails part way through the
        # layers leaves the sequence as it was (as the KV cache, whose writes past `length` are unread)
        self._pending: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._clear_recurrent()

    def _clear_recurrent(self) -> None:
        for i in self.recurrent_layers:
            self.conv[i], self.ssm[i] = empty_state(self.cfg)

    # -- the KVCache interface -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.kv.capacity

    @property
    def dtype(self) -> np.dtype:
        return self.kv.dtype

    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def k(self) -> dict[int, np.ndarray]:
        return self.kv.k

    @property
    def v(self) -> dict[int, np.ndarray]:
        return self.kv.v

    def check(self, pos: int, n_new: int) -> None:
        """Refuse, before any layer runs, a write the KV cache refuses or one that neither continues the
        sequence at its end nor restarts it at 0 (the recurrent state holds no earlier position to resume from)."""
        self.kv.check(pos, n_new)
        self._pending.clear()  # left by a call that failed
        if self.recurrent_layers and pos not in (0, self.length):
            raise ValueError(
                f"position {pos}: a recurrent state continues a sequence only at its end ({self.length}) or "
                "restarts it at 0; it cannot rewind to an earlier position"
            )

    def update(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.kv.update(layer, pos, k, v)

    def advance(self, end: int) -> None:
        for i, (conv, ssm) in self._pending.items():
            self.conv[i], self.ssm[i] = conv, ssm
        self._pending.clear()
        self.kv.advance(end)

    def truncate(self, length: int) -> None:
        """Keep positions 0..length-1 if the recurrent layers allow it (length 0 or the current length); any
        other cut clears the sequence (length becomes 0), since a recurrent state cannot drop positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a state of {self.length} positions to {length}")
        if length != self.length and self.recurrent_layers:
            length = 0
        if length == 0:
            self._clear_recurrent()
        self.kv.truncate(length)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + sum(a.nbytes for a in self.conv.values()) + sum(a.nbytes for a in self.ssm.values())

    # -- the recurrent layers ---------------------------------------------------------------------------------
    def recurrent(self, layer: int, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """(conv state, recurrent state) of `layer` before position `pos`: zeros when the sequence restarts at 0."""
        if pos == 0:
            return empty_state(self.cfg)
        return self.conv[layer], self.ssm[layer]

    def set_recurrent(self, layer: int, conv: np.ndarray, ssm: np.ndarray) -> None:
        """The states after this call's positions, in effect from `advance` (the end of the forward call)."""
        self._pending[layer] = (conv, ssm)

    def resized(self, capacity: int) -> HybridState:
        """A copy with room for `capacity` positions (the shard engine grows caches this way)."""
        if capacity < self.length:
            raise ContextLengthError(f"capacity {capacity} cannot hold the {self.length} positions of this state")
        grown = HybridState(self.layers, capacity, self.n_kv_heads, self.head_dim, self.cfg, self.dtype)
        for i in self.kv.k:
            grown.kv.k[i][: self.length] = self.kv.k[i][: self.length]
            grown.kv.v[i][: self.length] = self.kv.v[i][: self.length]
        for i in self.recurrent_layers:
            grown.conv[i], grown.ssm[i] = self.conv[i].copy(), self.ssm[i].copy()
        grown.advance(self.length)
        return grown

    def __repr__(self) -> str:
        return (
            f"HybridState(layers={self.layers}, recurrent={self.recurrent_layers}, length={self.length}, "
            f"capacity={self.capacity})"
        )
