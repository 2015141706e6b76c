"""The `ggufpy` command line: one subcommand per module in this package.

Each module in `COMMANDS` exposes `register(subparsers)`, which adds its parser and sets `func=run`,
where `run(args) -> int` returns the exit code. A module is imported only when `main` builds the parser,
so adding a command is one line here; commands keep their heavy imports inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .. import __version__
from ..errors import GGUFError

COMMANDS = ["inspect", "run", "chat", "trace", "bench", "perplexity", "quantize", "imatrix", "diff", "serve"]

# `ggufpy.numerics.NUMERICS`'s names, here so that building the parser imports no NumPy (tests/test_cli_run.py)
NUMERICS_MODES = ("exact", "llamacpp", "llamacpp-avx2")

EXIT_ERROR = 2  # the same code argparse uses for a bad command line


class UsageError(Exception):
    """A mistake in what the user asked for (a value out of range, a template that fails): one line, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ggufpy", description="A pure-NumPy reference interpreter for GGUF models (llama.cpp's file format)."
    )
    parser.add_argument("--version", action="version", version=f"ggufpy {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    return parser


def resolve_numerics(name: str) -> str:
    """ "host" -> the mode replaying the llama.cpp build this CPU runs (`numerics.host_llamacpp_mode`)."""
    if name != "host":
        return name
    from ..numerics import host_llamacpp_mode

    return host_llamacpp_mode()


def note_numerics(mode: str) -> None:
    """One stderr line when `--numerics llamacpp` (the replay of llama.cpp's AVX-512 build, the goldens') is asked
    on a CPU whose llama.cpp runs the AVX2 kernels, which round differently (docs/conformance.md)."""
    if mode != "llamacpp":
        return
    from ..numerics import host_llamacpp_mode

    host = host_llamacpp_mode()
    if host != mode:
        print(
            f"ggufpy: note: --numerics llamacpp replays llama.cpp's AVX-512 build; this CPU has no AVX-512, and "
            f"the llama.cpp it runs is replayed by --numerics {host}",
            file=sys.stderr,
        )


def error(message: object) -> int:
    """Print `ggufpy: error: MESSAGE` as one line on stderr and return the error exit code."""
    print(f"ggufpy: error: {' '.join(str(message).splitlines())}", file=sys.stderr)
    return EXIT_ERROR


def main(argv: list[str] | None = None) -> int:
    """Run the command line and return its exit code (the console script passes it to `sys.exit`)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version and usage errors: return their code instead of exiting
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_ERROR)
    try:
        return args.func(args)
    except (GGUFError, UsageError) as e:
        return error(e)
    except BrokenPipeError:
        # The reader of our stdout went away (`ggufpy inspect --tensors m.gguf | head`): silence the
        # flush at interpreter exit, as the Python docs on SIGPIPE recommend.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as e:  # a missing file, a packaged model that is not installed, a permission problem
        return error(e)
    except KeyboardInterrupt:
        return 130
