"""`ggufpy run -p PROMPT`: stream a completion (or, with --chat, a chat reply) to stdout.

Load time, first-use kernel setup and speeds go to stderr at the end, so stdout holds only the generated text.
With --chat the reply is greedy unless --temp is given (docs/chat.md says why).
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time

from . import NUMERICS_MODES, UsageError, note_numerics, resolve_numerics

DEFAULT_MAX_TOKENS = 256
COMPLETION_TEMP = 0.8  # llama.cpp's default for plain completion
# Chat is greedy by default: a small model's first reply token is often a near tie (SmolLM2 on the README
# question: "The" 54%, "L" 36%), and sampling it makes the headline answer a coin flip (docs/chat.md).
CHAT_TEMP = 0.0
NOTICE_AFTER_S = 1.0  # say what the kernel setup is doing only when it takes this long (a cold numba cache)
# the products of a decode step (`LayerWeights`), whose kernels compile ahead
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _number(kind, low: float | None = None, high: float | None = None, low_open: bool = False):
    """An argparse type: a finite number of `kind` in [low, high] (low excluded when `low_open`)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if low is not None and (value <= low if low_open else value < low):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if low_open else '>='} {low}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{text} must be <= {high}")
        return value

    return parse


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Options shared by `run` and `chat`: which model, which engine, how long, how to sample."""
    from ..packaged import describe_packaged

    p.add_argument(
        "-m",
        "--model",
        default=None,
        help=f"GGUF file or packaged model: {describe_packaged()} (default: smollm2, SmolLM2-135M-Instruct)",
    )
    p.add_argument("--backend", default=None, help="numpy or numba (default: numba when installed)")
    p.add_argument(
        "--numerics",
        default="exact",
        choices=(*NUMERICS_MODES, "host"),
        help="exact (float32, the default) or llama.cpp's arithmetic: host = the build this CPU runs, whose integer "
        "kernels decode 4-bit models faster (docs/performance.md)",
    )
    p.add_argument(
        "-c",
        "--ctx-size",
        type=_number(int, 1),
        default=None,
        help="positions the KV cache holds, prompt and reply (default: the model's context length)",
    )
    p.add_argument(
        "--kv-type",
        choices=["q8_0"],
        default=None,
        help="store K and V as Q8_0 blocks, like llama.cpp's -ctk q8_0 -ctv q8_0 (default: f32, f16 in llamacpp)",
    )
    p.add_argument(
        "-n",
        "--max-tokens",
        type=_number(int, 0),
        default=DEFAULT_MAX_TOKENS,
        help=f"most tokens to generate (default {DEFAULT_MAX_TOKENS})",
    )
    p.add_argument(
        "--temp",
        type=_number(float, 0),
        default=None,
        help=f"temperature; 0 = greedy (default {COMPLETION_TEMP}; chat: greedy, see docs/chat.md)",
    )
    p.add_argument("--top-k", type=_number(int, 0), default=40, help="0 disables it (default 40)")
    p.add_argument("--top-p", type=_number(float, 0, 1), default=0.95, help="1 disables it (default 0.95)")
    p.add_argument("--min-p", type=_number(float, 0, 1), default=0.05, help="0 disables it (default 0.05)")
    p.add_argument(
        "--repeat-penalty", type=_number(float, 0, low_open=True), default=1.0, help="1 disables it (default 1)"
    )
    p.add_argument("--seed", type=int, default=None, help="random seed, for a reproducible run")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME",
        help="use a built-in chat template instead of the file's: plain, chatml, gemma, llama3, ... (docs/chat.md)",
    )
    p.add_argument(
        "--special-in-content",
        action="store_true",
        help="parse special-token text typed in messages as control tokens (off: see docs/chat.md, prompt injection)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="generate text from a prompt", description=__doc__)
    p.add_argument("-p", "--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--system", default=None, help="a system message (with --chat)")
    add_model_args(p)
    add_ray_args(p)
    p.set_defaults(func=run)


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """Pipeline-parallel runs on a Ray cluster (docs/distributed.md)."""
    g = p.add_argument_group("Ray cluster (pip install 'ggufpy[ray]'; docs/distributed.md)")
    g.add_argument(
        "--ray", metavar="ADDRESS", default=None, help="run the layers as stages on this Ray cluster (ray://host:10001)"
    )
    g.add_argument("--stages", type=_number(int, 1), default=None, help="stages (default: one per node)")
    g.add_argument("--layer-ranges", default=None, metavar="0-14,15-29", help="explicit stage layers, inclusive")
    g.add_argument(
        "--hidden-f16", action="store_true", help="send hidden states as float16 (half the bytes, not bit-identical)"
    )


def clean_text(text: str, what: str) -> str:
    """Command-line or stdin text as valid Unicode: bytes that are not UTF-8 become U+FFFD, with a note.

    Python hands undecodable argv bytes over as lone surrogates (PEP 383), which no tokenizer accepts.
    """
    fixed = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if fixed != text:
        print(f"ggufpy: {what} is not valid UTF-8; the invalid bytes were replaced with U+FFFD", file=sys.stderr)
    return fixed


def load_model(args: argparse.Namespace):
    """The model (a `RayPipeline` with --ray) and its load time."""
    from ..loading import load

    t0 = time.perf_counter()
    if getattr(args, "ray", None):
        model = load_pipeline(args)
    else:
        numerics = resolve_numerics(getattr(args, "numerics", "exact"))
        note_numerics(numerics)
        model = load(args.model, backend=args.backend, numerics=numerics)  # backend None: numba when it imports
    return model, time.perf_counter() - t0


def load_pipeline(args: argparse.Namespace, max_sequences: int = 1):
    """A `RayPipeline` for `max_sequences` sequences of --ctx-size positions (default: the model's context)."""
    try:
        from ..distributed import PlanError, RayPipeline
    except ImportError as e:
        raise UsageError(f"--ray needs the ray extra (pip install 'ggufpy[ray]'): {e}") from None
    from ..shard import read_config

    if args.stages is not None and args.layer_ranges is not None:
        raise UsageError("give --stages or --layer-ranges, not both")
    try:
        return RayPipeline(
            args.model,
            address=args.ray,
            stages=args.stages,
            ranges=args.layer_ranges,
            backend=args.backend or "numba",
            ctx_size=min(args.ctx_size or 1 << 62, read_config(args.model).context_length),
            max_sequences=max_sequences,
            numerics=resolve_numerics(getattr(args, "numerics", "exact")),
            hidden_dtype="float16" if args.hidden_f16 else "float32",
        )
    except PlanError as e:
        raise UsageError(f"--ray: {e}") from None


def compile_early(args: argparse.Namespace) -> None:
    """On a cold numba cache, start the compile worker before the model loads, on the output head's kernel
    (what the first token waits for): its seconds of compiling then overlap the load."""
    if args.backend not in (None, "numba") or getattr(args, "ray", None):
        return
    try:
        from ..kernels import _numba, attention, compile_worker, ops
    except ImportError:  # no numba: the NumPy backend runs
        return
    # kernels every model's decode uses: absent, nothing ran here yet (other gaps are filled as they show)
    if _numba.cache_is_cold([ops._rms_norm, attention._attention]):
        compile_worker.call_in_worker("ggufpy.kernels.compile_worker", "head", args.model)


def prepare_kernels(model, prompt_tokens: int | None = None, out=None) -> float:
    """Compile (or load from numba's disk cache) the kernels a prefill of ``prompt_tokens`` (None: any length)
    and its first token use; return the seconds.

    numba compiles a kernel on its first call (cached on disk afterwards): done here, that wait is neither
    silent (a line appears once it lasts) nor counted in the reported speeds. Only the prompt's own path runs
    here, on a scratch cache; the output head's and the decode step's kernels compile meanwhile in a worker
    process on the other core (`NumbaBackend.compile_ahead`), so the first token waits for the head's only.
    Whatever compiles where, the kernels are the same, so the tokens are those of a warm cache.
    """
    if getattr(model.backend, "name", "") != "numba":
        return 0.0
    import numpy as np

    out = out or sys.stderr
    notice = threading.Timer(
        NOTICE_AFTER_S,
        lambda: print(
            "ggufpy: preparing the numba kernels (compiled on first use, ~10-30 s; cached on disk for later runs)",
            file=out,
            flush=True,
        ),
    )
    notice.daemon = True
    t0 = time.perf_counter()
    notice.start()
    try:
        be, w = model.backend, model.weights
        listed = getattr(be, "row_kernels", None) is not None
        head = be.row_kernels([w.output]) if listed and model.layers.stop == model.config.n_layers else []
        matrices = [getattr(lw, name, None) for lw in w.layers.values() for name in LAYER_MATRICES]
        decode = be.row_kernels(matrices, attention=True) if listed else []  # []: warmed here by running them
        blas_rows = getattr(be, "blas_rows", None) or 16
        blas = prompt_tokens is None or prompt_tokens >= blas_rows
        # BLAS tiles: NumPy unpacks them, bit for bit, while the worker compiles their kernel
        tiles = be.unpack_kernels(matrices) if listed and blas and decode else []
        if head or tiles:
            be.compile_ahead(head + tiles)
        # the prompt's path: BLAS tiles from `blas_rows` rows on (kernels alike in every layer: the first
        # runs), else the fused kernels on pairs of rows (and one row for an odd count), in every layer but
        # the last when the worker has the head
        if blas:
            rows = [blas_rows] + ([] if prompt_tokens is not None else [2])
        else:
            rows = [2 + prompt_tokens % 2] if prompt_tokens > 1 else []
        rows += [] if decode and prompt_tokens is not None else [1]
        if head and any(n % 2 for n in rows):  # row kernels here: not while the worker compiles one (see
            for kernel, _ in head:  # `_numba.compile_in_background` on numba's cache index)
                be.await_compiles(kernel)
        stop = model.layers.start + 1 if tiles and len(rows) == 1 else model.layers.stop - (1 if head else 0)
        layers = range(model.layers.start, stop)
        cache = model.new_cache(capacity=sum(rows) + 1)
        token = model.tokenizer.bos_id if model.tokenizer is not None and model.tokenizer.bos_id is not None else 0
        for n in rows if len(layers) else []:
            model.forward(np.full(n, token, dtype=np.int64), cache.length, cache, layers=layers, last_only=True)
        if decode:  # compiled in the worker while the prompt runs (those the prompt's path compiled are skipped)
            be.compile_ahead(decode)
        for kernel, _ in head:
            be.await_compiles(kernel)
    finally:
        notice.cancel()
    seconds = time.perf_counter() - t0
    if seconds >= NOTICE_AFTER_S:
        print(f"ggufpy: kernels ready in {seconds:.1f} s", file=out, flush=True)
    return seconds


def context_size(model, args: argparse.Namespace) -> int:
    """--ctx-size, checked against the model's context length (the default)."""
    context = model.config.context_length
    if args.ctx_size is None:
        return context
    if args.ctx_size > context:
        raise UsageError(f"--ctx-size {args.ctx_size} exceeds the model's context length {context}")
    return args.ctx_size


def sampling_params(args: argparse.Namespace, default_temp: float):
    from ..sampling import SamplingParams

    return SamplingParams(
        temperature=default_temp if args.temp is None else args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        seed=args.seed,
    )


def stream(model, prompt_ids, args, sampling, cache, out=None):
    """Generate into `cache`, writing text as it comes; returns the finished `Generation`."""
    from ..generation import generate

    if len(prompt_ids) > cache.capacity:
        raise UsageError(f"the prompt has {len(prompt_ids)} tokens and the context holds {cache.capacity} (--ctx-size)")
    out = out or sys.stdout
    gen = generate(
        model, model.tokenizer, prompt_ids, max_tokens=args.max_tokens, sampling=sampling, stop=args.stop, cache=cache
    )
    for chunk in gen:
        out.write(chunk.text)
        out.flush()
    return gen


def chat_template(model, args: argparse.Namespace):
    """The chat template (--chat-template, else the file's, else the one chosen for it; its note printed as one
    line on stderr); its stop strings join --stop."""
    from ..chat import ChatTemplate

    if args.chat_template:
        try:
            template = ChatTemplate.by_name(args.chat_template, model.tokenizer)
        except (ImportError, ValueError) as e:
            raise UsageError(f"--chat-template: {e}") from None
    else:
        template = ChatTemplate.from_tokenizer(model.tokenizer, getattr(model.file, "metadata", None), warn=False)
    if template.note:
        print(f"ggufpy: {template.note}", file=sys.stderr)
    args.stop = [*args.stop, *template.stop]
    return template


def chat_prompt_ids(tok, messages, template=None, special_in_content: bool = False) -> list[int]:
    """The conversation rendered and tokenized, control tokens only where the template writes them."""
    from jinja2.exceptions import TemplateError

    from ..chat import encode_chat

    try:
        return encode_chat(tok, messages, template, special_in_content=special_in_content)
    except TemplateError as e:  # the template's raise_exception, a syntax error, a resource bound
        raise UsageError(f"chat template: {e}") from None


def report(result, load_seconds: float, setup_seconds: float, backend: str) -> None:
    """Load, kernel setup, prompt and generation speeds as one line on stderr (setup out of the speeds)."""
    setup = f", kernels {setup_seconds:.2f} s" if setup_seconds else ""
    cached = f" ({result.cached_tokens} cached)" if result.cached_tokens else ""
    print(
        f"\n[{backend}] load {load_seconds:.2f} s{setup} | prompt {result.prompt_tokens} tokens{cached}, "
        f"{result.prefill_tokens_per_second:.1f} tok/s | generated {result.completion_tokens} tokens, "
        f"{result.decode_tokens_per_second:.1f} tok/s | finish: {result.finish_reason}",
        file=sys.stderr,
    )


def run(args: argparse.Namespace) -> int:
    prompt = clean_text(args.prompt, "the prompt")
    system = clean_text(args.system, "--system") if args.system else None
    args.stop = [clean_text(s, "--stop") for s in args.stop]
    compile_early(args)
    model, load_s = load_model(args)
    tok = model.tokenizer
    view = None  # a harmony reply (gpt-oss) is printed by channel
    if args.chat:
        from .channels import reply_view

        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        template = chat_template(model, args)
        ids = chat_prompt_ids(tok, messages, template, args.special_in_content)
        view = reply_view(template)
    else:
        ids = tok.encode(prompt, add_special=True, parse_special=args.special_in_content)
    if not ids:
        raise UsageError("the prompt is empty and this model adds no BOS token to start from: give some text")
    sampling = sampling_params(args, CHAT_TEMP if args.chat else COMPLETION_TEMP)
    if args.ray:
        try:
            result = stream_pipeline(model, ids, args, sampling, view)
        finally:
            model.shutdown()
        name = f"ray, {len(model.plan)} stages, {model.backend_name}"
        setup_s = 0.0  # the stages prepared their kernels while loading
    else:
        cache = model.new_cache(capacity=context_size(model, args), kv_type=args.kv_type)
        setup_s = prepare_kernels(model, len(ids))
        result = stream(model, ids, args, sampling, cache, view).result
        name = model.backend.name
    if view is not None:
        view.close()
    if view is not None or not result.text.endswith("\n"):
        print()
    report(result, load_s, setup_s, name)
    return 0


def stream_pipeline(pipe, prompt_ids, args, sampling, out=None):
    """`stream` through a `RayPipeline` (its last stage samples); returns the `GenerationResult`."""
    if len(prompt_ids) >= pipe.ctx_size:
        raise UsageError(f"the prompt has {len(prompt_ids)} tokens and the context holds {pipe.ctx_size} (--ctx-size)")
    out = out or sys.stdout
    gen = pipe.stream(prompt_ids, max_tokens=args.max_tokens, sampling=sampling, stop=args.stop)
    for chunk in gen:
        out.write(chunk.text)
        out.flush()
    return gen.result
