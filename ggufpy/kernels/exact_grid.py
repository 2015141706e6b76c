"""The exact numerics' decode kernels for IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M:
f32 activations times the blocks as stored, decoded in registers
(being written: until then `rawblocks._matvec` computes them)."""

from __future__ import annotations

KERNELS: dict = {}
"""GGML type -> kernel(q u8[G, 64, row bytes], xv f32[T, cols], out f32[T, G*64], threads)."""
