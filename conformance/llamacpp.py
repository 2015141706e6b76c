"""Run llama.cpp (through llama-cpp-python) and capture its intermediate tensors with `cb_eval`.

`cb_eval` is ggml's scheduler eval callback (`ggml_backend_sched_eval_callback` in ggml-backend.h): the
scheduler asks it about every graph node (`ask=True`; answering True makes the scheduler compute up to that
node and stop) and then hands it the computed tensor (`ask=False`). llama.cpp names its nodes `l_out-N`,
`attn_norm-N`, `Qcur-N`..., so capturing a name set gives llama.cpp's own intermediate values.

Everything runs with `SETTINGS`, the one configuration the goldens, the live checker and ggufpy's
`llamacpp` numerics all assume (see docs/conformance.md). Needs `pip install 'ggufpy[conformance]'`.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ggufpy.constants import GGMLType


@dataclass(frozen=True)
class LlamaCppSettings:
    """The llama.cpp context configuration every conformance run uses.

    flash_attn off: ggml's plain attention (mul_mat of f16 K by Q rounded to f16, soft_max in f32, mul_mat
    of f16 V by the probabilities rounded to f16) has rounding points that ggufpy reproduces exactly; the
    flash-attention kernel accumulates V in fp16 with an online softmax instead. n_ubatch >= every prompt,
    so a prompt is one ubatch (one graph). KV cache f16 (llama.cpp's default). Weight repacking (the
    CPU_REPACK buffer, llama.cpp's default) stays on: it changes the summation order only.
    """

    n_threads: int = 2
    n_ctx: int = 512
    n_batch: int = 512
    n_ubatch: int = 512
    flash_attn: bool = False
    kv_type: GGMLType = GGMLType.F16
    repack: bool = True

    def as_dict(self) -> dict:
        return {
            "n_threads": self.n_threads,
            "n_ctx": self.n_ctx,
            "n_batch": self.n_batch,
            "n_ubatch": self.n_ubatch,
            "flash_attn": self.flash_attn,
            "kv_type": self.kv_type.name,
            "repack": self.repack,
        }


SETTINGS = LlamaCppSettings()

_GGML_MAX_DIMS, _GGML_MAX_SRC, _GGML_MAX_OP_PARAMS, _GGML_MAX_NAME = 4, 10, 64, 64


class GGMLTensor(ctypes.Structure):
    """`struct ggml_tensor` from ggml.h (the layout shipped in llama-cpp-python's include/ggml.h)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * _GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * _GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (_GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * _GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * _GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


_HOST_DTYPES = {int(GGMLType.F32): np.float32, int(GGMLType.F16): np.float16, int(GGMLType.I32): np.int32}


def tensor_to_numpy(t: GGMLTensor) -> np.ndarray:
    """Copy a computed host tensor into a NumPy array of shape reversed(ne), honouring its strides."""
    dtype = _HOST_DTYPES.get(t.type)
    if dtype is None or not t.data:
        raise ValueError(f"cannot read tensor {t.name.decode()!r} of ggml type {t.type}")
    ne = [int(t.ne[i]) for i in range(_GGML_MAX_DIMS)]
    nb = [int(t.nb[i]) for i in range(_GGML_MAX_DIMS)]
    extent = sum((n - 1) * s for n, s in zip(ne, nb, strict=True)) + np.dtype(dtype).itemsize
    buf = (ctypes.c_char * extent).from_address(t.data)
    flat = np.frombuffer(buf, np.uint8)
    view = np.lib.stride_tricks.as_strided(flat.view(dtype), shape=ne[::-1], strides=nb[::-1])
    return np.array(view, dtype=np.float32 if dtype != np.int32 else np.int32)


def _squeeze_leading(a: np.ndarray, keep: int) -> np.ndarray:
    """Drop size-1 leading axes (ggml tensors are 4-D) but keep at least `keep` axes."""
    while a.ndim > keep and a.shape[0] == 1:
        a = a[0]
    return a


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _lib():
    try:
        import llama_cpp
    except ImportError as e:
        raise RuntimeError("llama.cpp comparisons need llama-cpp-python: pip install 'ggufpy[conformance]'") from e
    return llama_cpp


_BACKEND_READY = False
_LOG_CALLBACK = None


def _init_backend() -> None:
    """llama_backend_init once, with llama.cpp's log output silenced."""
    global _BACKEND_READY, _LOG_CALLBACK
    if _BACKEND_READY:
        return
    llama_cpp = _lib()
    _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, user: None)
    llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    _BACKEND_READY = True


def versions() -> dict[str, str]:
    """What produced a golden: llama-cpp-python's version, ggml's version and build commit, CPU features."""
    llama_cpp = _lib()
    ggml = _ggml_base()
    for fn in (ggml.ggml_version, ggml.ggml_commit):
        fn.restype = ctypes.c_char_p
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "ggml": ggml.ggml_version().decode(),
        "ggml_commit": ggml.ggml_commit().decode(),
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }


def host_isa() -> str:
    """The x86 build (`ggufpy.quants.x86.simd.ISAS`) the installed llama.cpp was compiled for: which replay
    its live results are compared with."""
    from ggufpy.quants.x86.simd import isa_of

    return isa_of(versions()["system_info"])


class LlamaCpp:
    """One llama.cpp model and context, configured with `settings`. Use as a context manager."""

    def __init__(self, path: str | os.PathLike, settings: LlamaCppSettings = SETTINGS):
        llama_cpp = _lib()
        _init_backend()
        self.path = Path(path)
        self.settings = settings
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_extra_bufts = settings.repack
        self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {self.path}")
        self._want: Callable[[str], bool] | None = None
        self._captured: dict[str, np.ndarray] = {}
        self._cb = llama_cpp.ggml_backend_sched_eval_callback(self._eval_callback)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = settings.n_ctx
        cparams.n_batch = settings.n_batch
        cparams.n_ubatch = settings.n_ubatch
        cparams.n_threads = cparams.n_threads_batch = settings.n_threads
        cparams.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.type_k = cparams.type_v = int(settings.kv_type)
        cparams.cb_eval = self._cb
        cparams.cb_eval_user_data = None
        cparams.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise RuntimeError(f"llama.cpp could not create a context for {self.path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.n_layers = llama_cpp.llama_model_n_layer(self._model)

    # -- the callback ----------------------------------------------------------------------------------
    def _eval_callback(self, t_ptr, ask, user_data) -> bool:
        t = GGMLTensor.from_address(t_ptr)
        name = t.name.decode(errors="replace")
        if ask:
            return self._want is not None and self._want(name)
        if self._want is not None and self._want(name):
            self._captured[name] = tensor_to_numpy(t)  # a later node of the same name (Qcur after RoPE) wins
        return True

    # -- running -------------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        llama_cpp = _lib()
        raw = text.encode()
        buf = (llama_cpp.llama_token * (len(raw) + 16))()
        n = llama_cpp.llama_tokenize(self._vocab, raw, len(raw), buf, len(buf), add_special, parse_special)
        if n < 0:
            raise RuntimeError(f"llama.cpp tokenization needs {-n} tokens, more than the buffer")
        return list(buf[:n])

    def _decode(self, tokens: list[int], start: int, all_logits: bool) -> np.ndarray:
        llama_cpp = _lib()
        n = len(tokens)
        batch = llama_cpp.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i, tok in enumerate(tokens):
                batch.token[i] = int(tok)
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = all_logits or i == n - 1
            rc = llama_cpp.llama_decode(self._ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} for {n} tokens at position {start}")
            rows = n if all_logits else 1
            ptr = llama_cpp.llama_get_logits(self._ctx)
            return np.ctypeslib.as_array(ptr, shape=(rows * self.n_vocab,)).reshape(rows, self.n_vocab).copy()
        finally:
            llama_cpp.llama_batch_free(batch)

    def _reset(self) -> None:
        llama_cpp = _lib()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._ctx), True)

    def run(self, tokens: Iterable[int], capture: Iterable[str] | Callable[[str], bool] = ()) -> tuple:
        """Prefill `tokens` in one ubatch from an empty cache: (logits (T, V) f32, {name: tensor}).

        `capture`: node names (`"l_out-3"`) or a predicate on names. Tensors come back in NumPy order, size-1
        leading axes dropped: `l_out-N` (T, D), `Qcur-N` (T, H, E), `result_output` (T, V).
        """
        tokens = [int(t) for t in tokens]
        if len(tokens) > self.settings.n_ubatch:
            raise ValueError(f"{len(tokens)} tokens do not fit in one ubatch of {self.settings.n_ubatch}")
        names = None if callable(capture) else set(capture)
        self._want = capture if names is None else (lambda name: name in names)
        self._captured = {}
        try:
            self._reset()
            logits = self._decode(tokens, 0, all_logits=True)
        finally:
            self._want = None
        keep = {
            name: _squeeze_leading(a, 3 if name.split("-")[0] in _HEADED else 2) for name, a in self._captured.items()
        }
        return logits, keep

    def greedy(self, tokens: Iterable[int], n: int) -> list[int]:
        """`n` tokens of greedy (argmax) continuation after the prompt, decoding one token at a time."""
        tokens = [int(t) for t in tokens]
        self._reset()
        logits = self._decode(tokens, 0, all_logits=False)
        out: list[int] = []
        for _ in range(n):
            nxt = int(np.argmax(logits[-1]))
            out.append(nxt)
            logits = self._decode([nxt], len(tokens) + len(out) - 1, all_logits=False)
        return out

    def greedy_token_by_token(self, tokens: Iterable[int], n: int, banned: Iterable[int] = ()) -> list[int]:
        """`n` greedy tokens after the prompt, every token decoded alone (the prompt too, one `llama_decode` of
        one token each: what `ggufpy serve` computes in the llamacpp numerics), `banned` tokens never picked."""
        tokens = [int(t) for t in tokens]
        banned = np.asarray(list(banned), dtype=np.int64)
        self._reset()
        for pos, t in enumerate(tokens):
            logits = self._decode([t], pos, all_logits=False)
        out: list[int] = []
        for _ in range(n):
            row = logits[-1].copy()
            row[banned] = -np.inf
            out.append(int(np.argmax(row)))
            logits = self._decode([out[-1]], len(tokens) + len(out) - 1, all_logits=False)
        return out

    def close(self) -> None:
        llama_cpp = _lib()
        if getattr(self, "_ctx", None):
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_HEADED = {"Qcur", "Kcur", "Vcur"}  # (T, heads, E) tensors


# -- ggml's C functions: quantizers and vec_dot, for fixtures and unit tests ------------------------------------


def _ggml_base():
    return _lib() and _load("ggml-base")


def _ggml_cpu():
    return _lib() and _load("ggml-cpu")


def _load(name: str):
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for candidate in (f"lib{name}.so", f"lib{name}.dylib", f"{name}.dll"):
        if (lib_dir / candidate).exists():
            return ctypes.CDLL(str(lib_dir / candidate))
    raise RuntimeError(f"llama-cpp-python at {lib_dir} ships no {name} library")


def ggml_quantize(x: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """Quantize rows of f32 with ggml's own quantizer (`ggml_quantize_chunk`): the code `llama-quantize` runs.
    No importance matrix, except for the types ggml refuses to quantize without one
    (`ggml_quantize_requires_imatrix`: IQ2_XXS, IQ2_XS, IQ1_S), which get one of ones. Returns u8 (..., row_bytes)."""
    from ggufpy.quants import quant_type

    lib = _ggml_base()
    fn = lib.ggml_quantize_chunk
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    fn.argtypes += [ctypes.c_void_p]
    fn.restype = ctypes.c_size_t
    qt = quant_type(ggml_type)
    x = np.ascontiguousarray(x, np.float32)
    n_per_row = x.shape[-1]
    nrows = x.size // n_per_row
    out = np.zeros((nrows, qt.row_bytes(n_per_row)), np.uint8)
    lib.ggml_quantize_requires_imatrix.argtypes, lib.ggml_quantize_requires_imatrix.restype = (
        [ctypes.c_int],
        ctypes.c_bool,
    )
    imatrix = np.ones(n_per_row, np.float32) if lib.ggml_quantize_requires_imatrix(int(ggml_type)) else None
    written = fn(
        int(ggml_type),
        x.ctypes.data,
        out.ctypes.data,
        0,
        nrows,
        n_per_row,
        None if imatrix is None else imatrix.ctypes.data,
    )
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes for {qt.name}, expected {out.nbytes}")
    return out.reshape(*x.shape[:-1], out.shape[-1])


class _TypeTraitsCPU(ctypes.Structure):
    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_VEC_DOT = ctypes.CFUNCTYPE(
    None,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
)


def ggml_cpu_matmul(w_rows: np.ndarray, w_type: GGMLType, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The CPU backend's `from_float` + `vec_dot` for one weight type, row by row (ggml-cpu.c type_traits_cpu).

    w_rows: u8 (out, row_bytes); x: f32 (T, in). Returns (y (T, out) f32, the activation blocks u8
    (T, act_row_bytes), the vec_dot type id).
    """
    from ggufpy.quants import quant_type

    cpu = _ggml_cpu()
    cpu.ggml_cpu_init.restype = None
    cpu.ggml_cpu_init()
    get = cpu.ggml_get_type_traits_cpu
    get.argtypes, get.restype = [ctypes.c_int], ctypes.POINTER(_TypeTraitsCPU)
    traits = get(int(w_type)).contents
    x = np.ascontiguousarray(x, np.float32)
    T, n = x.shape
    at = quant_type(traits.vec_dot_type)
    acts = np.zeros((T, at.row_bytes(n)), np.uint8)
    if traits.vec_dot_type == int(GGMLType.F32):
        acts = x.view(np.uint8).reshape(T, -1).copy()
    else:  # mul_mat converts with the from_float of the vec_dot type (a weight type's own is its quantizer)
        from_float = _FROM_FLOAT(get(traits.vec_dot_type).contents.from_float)
        for t in range(T):
            from_float(x[t].ctypes.data, acts[t].ctypes.data, n)
    vec_dot = _VEC_DOT(traits.vec_dot)
    w_rows = np.ascontiguousarray(w_rows)
    y = np.zeros((T, w_rows.shape[0]), np.float32)
    s = ctypes.c_float()
    for t in range(T):
        for o in range(w_rows.shape[0]):
            vec_dot(n, ctypes.addressof(s), 0, w_rows[o].ctypes.data, 0, acts[t].ctypes.data, 0, 1)
            y[t, o] = s.value
    return y, acts, traits.vec_dot_type
