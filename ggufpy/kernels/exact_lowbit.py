"""The exact numerics' decode kernels for TQ1_0, TQ2_0, MXFP4, NVFP4 and Q1_0:
f32 activations times the blocks as stored, decoded in registers
(being written: until then `rawblocks._matvec` computes them)."""

from __future__ import annotations

KERNELS: dict = {}
"""GGML type -> kernel(q u8[G, 64, row bytes], xv f32[T, cols], out f32[T, G*64], threads)."""
