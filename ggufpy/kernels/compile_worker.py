"""The compile worker: compiles numba kernels into the disk cache for another process (`_numba.ELSEWHERE`).
Both ends: `main` runs in the worker, `job` / `call_in_worker` in the process that asks.

    python -m ggufpy.kernels.compile_worker     # jobs on stdin, one report line per job on stdout

Each job is a pickled (job id, module, function name, numba argument types or None, arguments); the worker
imports the module, compiles the function for those types (numba writes it to its disk cache,
`NUMBA_CACHE_DIR` as inherited), or calls it with the arguments when there are no types (`head`), and prints
"<job id> ok" (or "<job id> error ...": the process that asked then compiles it itself). It exits when its
stdin closes. A second process, because numba compiles under one lock per process and mostly in Python:
this way the compile runs on another core while the process that asked runs what it already has.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import subprocess
import sys
import threading

from . import _numba


class _Worker:
    """The compile worker process: jobs (module, function name, argument types) pickled to its stdin, one
    line "<job id> ok|error" back per job; its events are set as the lines come (`failed` on an error), and
    all of them if it exits."""

    def __init__(self):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds ggufpy/
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ggufpy.kernels.compile_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # failures come back as report lines; numba's warnings are not ours to print
            env=env,
        )
        self.events: dict[int, threading.Event] = {}
        self.jobs = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._read, name="ggufpy-compile-worker", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            job, status = line.split()[:2]
            with self.lock:
                event = self.events.pop(int(job), None)
            if event is not None:
                event.failed = status != b"ok"
                event.set()
        with self.lock:  # the worker exited: what it still had compiles here on first call, if it comes
            for event in self.events.values():
                event.set()
            self.events.clear()

    def submit(self, module: str, name: str, sig: tuple | None, args: tuple = ()) -> threading.Event:
        """Compile `module.name` for `sig`, or (sig None) call it with `args`."""
        event = threading.Event()
        with self.lock:
            job = self.jobs = self.jobs + 1
            self.events[job] = event
            try:
                pickle.dump((job, module, name, sig, args), self.proc.stdin)
                self.proc.stdin.flush()
            except (OSError, ValueError, pickle.PicklingError):
                self.events.pop(job, None)
                event.set()
        return event

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait()


_WORKER: list[_Worker | None] = []  # started on the first job; [None] if it could not start
_WORKER_LOCK = threading.Lock()


def _worker() -> _Worker | None:
    with _WORKER_LOCK:
        if not _WORKER:
            try:
                _WORKER.append(_Worker())
            except OSError:
                _WORKER.append(None)
        return _WORKER[0]


def job(kernel, sig: tuple) -> threading.Event | None:
    """An event set when the worker process has compiled `kernel` for `sig` into the disk cache (or failed),
    or None without a worker (then the compile runs in this process)."""
    worker = _worker()
    return None if worker is None else worker.submit(kernel.py_func.__module__, kernel.py_func.__qualname__, sig)


def call_in_worker(module: str, name: str, *args) -> threading.Event | None:
    """Start the worker process now (if it is not running) and have it call `module.name(*args)` before the
    compiles asked later: e.g. compiling what a model file will need while this process loads it."""
    worker = None if _numba.DISABLED else _worker()
    return None if worker is None else worker.submit(module, name, None, args)


@atexit.register  # before `_numba.wait_for_compiles`: the worker still finishes every job it was given
def _close_worker() -> None:
    if _WORKER and _WORKER[0] is not None:
        _WORKER[0].close()


def main() -> int:
    jobs = sys.stdin.buffer
    while True:
        try:
            job_id, module, name, sig, args = pickle.load(jobs)
        except EOFError:
            return 0
        try:
            fn = importlib.import_module(module)
            for part in name.split("."):
                fn = getattr(fn, part)
            if sig is None:
                fn(*args)
            else:
                fn.compile(sig)
            report = "ok"
        except Exception as e:  # reported: the asking process then compiles it itself, and raises
            report = f"error {type(e).__name__}: {e}".replace("\n", " ")[:500]
        print(job_id, report, flush=True)


def head(model: str | None, numerics: str = "exact") -> None:
    """Compile the kernel of the output head's one-row product (the first token's logits) for `model`, a file
    or packaged name as `ggufpy.load` takes it: started before the asking process has loaded the model."""
    from ..loading import load

    m = load(model, backend="numba", numerics=numerics, tokenizer=False)
    for kernel, sig in m.backend.row_kernels([m.weights.output]):
        kernel.compile(sig)


if __name__ == "__main__":
    sys.exit(main())
