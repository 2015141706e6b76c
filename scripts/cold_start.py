"""Time to first token of the README's command, cold (empty numba cache) and warm, each from a fresh process.

    python scripts/cold_start.py                         # 1 cold + 1 warm run of the README command
    python scripts/cold_start.py --rounds 3 -- -m gemma3  # extra arguments go to `ggufpy run`

Each round makes a fresh `NUMBA_CACHE_DIR`, runs `ggufpy run --chat -p "What is the capital of France?"` in a
new process (cold), then again in another new process on the cache that run left (warm). A small wrapper in
the child records when `ggufpy.loading.load` returns and when the first generated text reaches stdout; the
table shows the seconds in between (wall clock, and the CPU seconds the process used, which a busy machine
disturbs less: compiling is single-threaded), and the whole run's wall and CPU seconds, the compile worker's
process included (`ggufpy.kernels.compile_worker`: the first-token CPU column does not hold its share).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

PROMPT = "What is the capital of France?"

# Runs in the child: wrap `load` and stdout, run the CLI, print one JSON line of timings on stderr.
CHILD = r"""
import json, os, sys, time
t_start = time.perf_counter()
import ggufpy.loading as loading
marks = {}
_load = loading.load
def load(*a, **k):
    m = _load(*a, **k)
    marks["loaded"] = time.perf_counter(); marks["cpu_loaded"] = sum(os.times()[:2])
    return m
loading.load = load
class Out:
    def __init__(self, f): self.f = f
    def write(self, s):
        if s.strip() and "first" not in marks:
            marks["first"] = time.perf_counter(); marks["cpu_first"] = sum(os.times()[:2])
        return self.f.write(s)
    def __getattr__(self, name): return getattr(self.f, name)
sys.stdout = Out(sys.stdout)
from ggufpy.cli import main
code = main(sys.argv[1:])
sys.stdout = sys.stdout.f
print("TIMINGS " + json.dumps({
    "load_s": marks["loaded"] - t_start,
    "first_token_s": marks["first"] - marks["loaded"],
    "first_token_cpu_s": marks["cpu_first"] - marks["cpu_loaded"],
    "code": code,
}), file=sys.stderr)
"""


def run_once(cache_dir: str, extra: list[str]) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    cmd = [sys.executable, "-c", CHILD, "run", "--chat", "-p", PROMPT, *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("TIMINGS ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"ggufpy run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("TIMINGS ") :])
    result["text"] = proc.stdout
    result["reply"] = proc.stdout.strip().splitlines()[0][:60] if proc.stdout.strip() else ""
    # the whole run, the compile worker's process included (it is waited for at exit)
    result["total_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    result["total_wall_s"] = wall
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1, help="cold + warm pairs, each on a fresh cache (default 1)")
    ap.add_argument("--warm", type=int, default=1, help="warm runs after each cold one (default 1)")
    ap.add_argument("extra", nargs="*", help="arguments for `ggufpy run` (after --)")
    args = ap.parse_args()
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().split()[:3]}")
    print(
        "| run | load s | first token s (wall) | first token s (CPU) | whole run s (wall) "
        "| whole run CPU s, all processes | reply |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    same = True
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="numba-cold-") as cache_dir:
            texts = []
            for kind in ["cold"] + ["warm"] * args.warm:
                r = run_once(cache_dir, args.extra)
                texts.append(r["text"])
                print(
                    f"| {kind} | {r['load_s']:.2f} | {r['first_token_s']:.2f} | {r['first_token_cpu_s']:.2f} "
                    f"| {r['total_wall_s']:.2f} | {r['total_cpu_s']:.2f} | {r['reply']} |",
                    flush=True,
                )
            same = same and len(set(texts)) == 1
    print(f"cold and warm runs printed the same text: {same}")
    with open("/proc/loadavg") as f:
        print(f"load average after: {f.read().split()[:3]}")


if __name__ == "__main__":
    main()
