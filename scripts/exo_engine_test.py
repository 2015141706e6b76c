"""Run exo's own engine test against `ggufpy.exo.GGUFInferenceEngine`, with exo's own `Shard`.

    git -C exo archive 5f18faec1758ffa79d6db1d463b4b8bca211a0a8 exo/ | tar -x -C /tmp/exo-legacy
    python scripts/exo_engine_test.py /tmp/exo-legacy [--model smollm2] [--backend numpy] [--numerics exact]

exo's legacy tree (`exo/inference/`, deleted by exo commit 0fcee7083 of 2025-12-17; 5f18fae is the commit
before) is put on sys.path unchanged. Its test module `exo/inference/test_inference_engine.py` defines
`test_inference_engine(engine_1, engine_2, model_id, n_layers)` (a full shard against two half shards on two
engines: prefill and one decode step, compared with `np.array_equal`), then at import runs it on the MLX
engine. This script imports the module with the MLX engine stubbed so that its construction stops the module
there, then calls exo's `test_inference_engine` on two `GGUFInferenceEngine`s.

Stubbed, without editing exo's files: the MLX engine module (MLX is Apple-only); third-party packages the
imported exo modules need and this environment may lack (psutil, scapy, aiofiles), each only when it does not
import; `exo.download.new_shard_download` when it does not import (aiohttp): the test constructs its
`NewShardDownloader`, which the GGUF engine never calls for local models.

Then it registers the engine with `ggufpy.exo.install_into_exo` and drives exo's own `Node` class
(`exo/orchestration/node.py`) in a ring of two (or `--ring` N) nodes in this process: peers are in-memory
`PeerHandle`s that pass tensors as exo's gRPC server does (bytes, shape, dtype string), the partitions are
fixed, and the prompt goes in as exo's CLI sends it (`run_model_cli`: the chat template, `process_prompt`,
tokens through `on_token`). The tokens must equal a single node's and ggufpy's own greedy generation.
Exit status 0 when every run passes.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import sys
import time
import traceback
import types
from pathlib import Path


class _StopModuleRun(Exception):
    """Raised by the MLX stub: the test module's own MLX run ends its import there."""


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__ggufpy_stub__ = True
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def install_stubs() -> list[str]:
    """Stub what exo's imported modules need and cannot import here; returns the stubbed module names."""
    stubbed = []
    if not _importable("psutil"):  # exo.helpers: used by functions the test never calls
        _stub("psutil", WINDOWS=sys.platform.startswith("win"))
        stubbed.append("psutil")
    if not _importable("scapy.all"):  # exo.helpers: network interface discovery
        _stub("scapy")
        _stub("scapy.all", get_if_addr=lambda *a: "127.0.0.1", get_if_list=lambda: [])
        stubbed.append("scapy.all")
    if not _importable("aiofiles"):  # exo.inference.tokenizers
        _stub("aiofiles")
        _stub("aiofiles.os")
        stubbed.append("aiofiles")
    if not _importable("exo.download.new_shard_download"):

        class NewShardDownloader:
            async def ensure_shard(self, shard, inference_engine_name):
                raise RuntimeError(f"stubbed downloader: {shard.model_id!r} should be a local GGUF model")

        async def ensure_downloads_dir() -> Path:
            return Path.home() / ".cache" / "exo" / "downloads"

        _stub(
            "exo.download.new_shard_download",
            NewShardDownloader=NewShardDownloader,
            ensure_downloads_dir=ensure_downloads_dir,
        )
        stubbed.append("exo.download.new_shard_download")

    def mlx_engine(*args, **kwargs):
        raise _StopModuleRun

    importlib.import_module("exo.inference")
    _stub("exo.inference.mlx")
    _stub("exo.inference.mlx.sharded_inference_engine", MLXDynamicShardInferenceEngine=mlx_engine)
    stubbed.append("exo.inference.mlx.sharded_inference_engine")
    return stubbed


def load_exo_test(exo_root: Path) -> types.ModuleType:
    """exo's test module, imported up to (not including) its own MLX run."""
    path = exo_root / "exo" / "inference" / "test_inference_engine.py"
    spec = importlib.util.spec_from_file_location("exo.inference.test_inference_engine", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except _StopModuleRun:
        pass
    if not hasattr(module, "test_inference_engine"):
        raise RuntimeError(f"{path} defines no test_inference_engine")
    return module


def exo_ring_classes():
    """An in-memory `PeerHandle` and a fixed `PartitioningStrategy` (exo's ABCs, imported once exo is on sys.path)."""
    import numpy as np
    from exo.networking.peer_handle import PeerHandle
    from exo.topology.device_capabilities import UNKNOWN_DEVICE_CAPABILITIES
    from exo.topology.partitioning_strategy import PartitioningStrategy

    def wire(tensor):
        """What exo's gRPC transport does to a tensor (grpc_peer_handle.py / grpc_server.py `SendTensor`)."""
        data, shape, dtype = tensor.tobytes(), list(tensor.shape), str(tensor.dtype)
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)

    class InMemoryPeer(PeerHandle):
        def __init__(self, node):
            self.node = node

        def id(self):
            return self.node.id

        def addr(self):
            return f"in-memory:{self.node.id}"

        def description(self):
            return "in-memory"

        def device_capabilities(self):
            return UNKNOWN_DEVICE_CAPABILITIES

        async def connect(self):
            pass

        async def is_connected(self):
            return True

        async def disconnect(self):
            pass

        async def health_check(self):
            return True

        async def send_prompt(self, shard, prompt, request_id=None, inference_state=None):
            await self.node.process_prompt(shard, prompt, request_id, inference_state)

        async def send_tensor(self, shard, tensor, request_id=None, inference_state=None):
            await self.node.process_tensor(shard, wire(tensor), request_id, inference_state)

        async def send_example(self, *args, **kwargs):
            raise NotImplementedError

        async def send_loss(self, *args, **kwargs):
            raise NotImplementedError

        async def send_result(self, request_id, result, is_finished):
            self.node.on_token.trigger_all(request_id, list(result), is_finished)  # grpc_server.py `SendResult`

        async def send_opaque_status(self, request_id, status):
            self.node.on_opaque_status.trigger_all(request_id, status)

        async def collect_topology(self, visited, max_depth):
            return self.node.topology

    class FixedPartitions(PartitioningStrategy):
        def __init__(self, partitions):
            self.partitions = partitions

        def partition(self, topology):
            return self.partitions

    return InMemoryPeer, FixedPartitions


async def run_exo_ring(model_id: str, n_nodes: int, max_tokens: int, options: dict, question: str) -> list[int]:
    """Generate with exo's own Node class on `n_nodes` GGUF engines; returns the tokens exo's CLI collects."""
    import uuid

    from exo.inference.tokenizers import resolve_tokenizer
    from exo.models import build_base_shard, get_repo
    from exo.orchestration.node import Node
    from exo.topology.partitioning_strategy import Partition

    from ggufpy.exo import GGUFInferenceEngine

    InMemoryPeer, FixedPartitions = exo_ring_classes()
    ids = [f"node-{i}" for i in range(n_nodes)]
    partitions = FixedPartitions([Partition(ids[i], i / n_nodes, (i + 1) / n_nodes) for i in range(n_nodes)])
    nodes = [
        Node(i, None, GGUFInferenceEngine(None, **options), None, None, partitions, max_generate_tokens=max_tokens)
        for i in ids
    ]
    for node in nodes:
        node.peers = [InMemoryPeer(other) for other in nodes if other is not node]

    # exo/main.py `run_model_cli`, with node 0 as the node the prompt arrives at
    node, inference_class = nodes[0], GGUFInferenceEngine.__name__
    shard = build_base_shard(model_id, inference_class)
    if shard is None:
        raise RuntimeError(f"exo has no model card for {model_id!r} and {inference_class}")
    tokenizer = await resolve_tokenizer(get_repo(shard.model_id, inference_class))
    request_id = str(uuid.uuid4())
    callback = node.on_token.register(f"cli-wait-response-{request_id}")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    # run_model_cli collects tokens inside its `wait` predicate, which asyncio may evaluate more than once
    # per result (a single node repeats the first token that way); an observer sees each result once.
    tokens = []
    callback.on_next(lambda rid, new, finished: tokens.extend(new) if rid == request_id else None)
    await node.process_prompt(shard, prompt, request_id=request_id)
    await callback.wait(lambda rid, new, finished: rid == request_id and finished, timeout=300)
    for n in nodes:
        n.inference_engine.executor.shutdown()
    return tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exo_root", type=Path, help="folder holding exo's legacy `exo/` package")
    parser.add_argument("--model", action="append", help="model id (repeatable; default: smollm2)")
    parser.add_argument("--backend", action="append", help="numpy or numba (repeatable; default: numpy)")
    parser.add_argument("--numerics", action="append", help="exact or llamacpp (repeatable; default: exact)")
    parser.add_argument("--ring", type=int, default=2, help="nodes in exo's Node ring (0 skips it; default 2)")
    parser.add_argument("--max-tokens", type=int, default=32, help="exo's max_generate_tokens in the ring")
    args = parser.parse_args(argv)
    root = args.exo_root.resolve()
    if not (root / "exo" / "inference" / "test_inference_engine.py").is_file():
        parser.error(f"{root} has no exo/inference/test_inference_engine.py (extract exo's legacy tree there)")
    sys.path.insert(0, str(root))
    stubbed = install_stubs()

    from exo.inference.inference_engine import InferenceEngine
    from exo.inference.shard import Shard

    import ggufpy.exo
    from ggufpy.exo import GGUFInferenceEngine, resolve_model

    exo_test = load_exo_test(root)
    print(f"exo tree: {root} (exo.inference from {Path(sys.modules['exo.inference'].__file__).parent})")
    print(f"stubbed: {', '.join(stubbed)}")
    print(f"GGUFInferenceEngine subclasses exo's InferenceEngine: {issubclass(GGUFInferenceEngine, InferenceEngine)}")
    print(f"test module uses exo's Shard: {exo_test.Shard is Shard}")
    if not (ggufpy.exo.EXO_AVAILABLE and issubclass(GGUFInferenceEngine, InferenceEngine)):
        print("FAIL: ggufpy.exo did not pick up exo's InferenceEngine")
        return 1

    failures = 0
    for model_id in args.model or ["smollm2"]:
        n_layers = ggufpy.exo._n_layers(resolve_model(model_id))
        for backend in args.backend or ["numpy"]:
            for numerics in args.numerics or ["exact"]:
                options = {"backend": backend, "numerics": numerics}
                if backend == "numpy":
                    options["cache_bytes"] = 1 << 30  # keep every dequantized weight: faster, same results
                engines = [GGUFInferenceEngine(None, **options), GGUFInferenceEngine(None, **options)]
                label = f"model={model_id} n_layers={n_layers} backend={backend} numerics={numerics}"
                t0 = time.perf_counter()
                try:
                    asyncio.run(exo_test.test_inference_engine(*engines, model_id, n_layers))
                except Exception:
                    failures += 1
                    print(f"FAIL {label}")
                    traceback.print_exc()
                else:
                    print(f"PASS {label} ({time.perf_counter() - t0:.1f} s)")
                for engine in engines:
                    engine.executor.shutdown()
    if args.ring:
        failures += ring_checks(args)
    return 1 if failures else 0


def ring_checks(args) -> int:
    """exo's own Node loop on a ring of GGUF engines against one node and against ggufpy's generation."""
    import ggufpy
    from ggufpy.exo import install_into_exo
    from ggufpy.generation import generate_text
    from ggufpy.hf import HFStyleTokenizer
    from ggufpy.sampling import SamplingParams

    question = "What is the capital of France? Answer in one sentence."
    added = install_into_exo()
    print(f"install_into_exo: model cards added for {', '.join(added)}")
    failed = 0
    for model_id in args.model or ["smollm2"]:
        if model_id not in added:
            print(f"SKIP ring for {model_id!r}: exo model cards exist only for {added}")
            continue
        for backend in args.backend or ["numpy"]:
            for numerics in args.numerics or ["exact"]:
                options = {"backend": backend, "numerics": numerics}
                if backend == "numpy":
                    options["cache_bytes"] = 1 << 30
                label = f"exo Node ring model={model_id} backend={backend} numerics={numerics}"
                try:
                    t0 = time.perf_counter()
                    ring = asyncio.run(run_exo_ring(model_id, args.ring, args.max_tokens, options, question))
                    one = asyncio.run(run_exo_ring(model_id, 1, args.max_tokens, options, question))
                    model = ggufpy.load(model_id, **options)
                    tok = HFStyleTokenizer(model.tokenizer)
                    text = tok.apply_chat_template(
                        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
                    )
                    bos = tok.bos_token
                    # the engine's encode: special tokens parsed, BOS unless the template wrote it
                    prompt = model.tokenizer.encode(
                        text, add_special=not (bos and text.startswith(bos)), parse_special=True
                    )
                    ref = generate_text(
                        model, model.tokenizer, prompt, max_tokens=args.max_tokens, sampling=SamplingParams.greedy()
                    )
                    ends_at_eos = bool(ring) and ring[-1] == tok.eos_token_id
                    text = tok.decode(ring[:-1] if ends_at_eos else ring)
                    # exo stops at eos_token_id only, ggufpy at any end-of-generation token
                    same_text = text == ref.text or (ref.finish_reason == "eog" and not ends_at_eos)
                    ok = ring == one and ring[: len(ref.token_ids)] == list(ref.token_ids) and same_text
                except Exception:
                    failed += 1
                    print(f"FAIL {label}")
                    traceback.print_exc()
                    continue
                status = "PASS" if ok else "FAIL"
                failed += not ok
                print(f"{status} {label}, {args.ring} nodes: {len(ring)} tokens ({time.perf_counter() - t0:.1f} s)")
                print(f"    ring text: {text!r}")
                if not ok:
                    print(f"    ring {ring}\n    one  {one}\n    ref  {list(ref.token_ids)} {ref.text!r}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
