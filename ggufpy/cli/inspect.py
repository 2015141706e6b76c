"""`ggufpy inspect FILE [--json] [--tensors]`: what a GGUF file holds, without loading any weights.

One function, `describe`, gathers every fact into a JSON-ready dict; `--json` prints it and the text
renderer formats it, so the two outputs always agree. Long metadata arrays (vocabularies, merges,
scores) are summarised by length, element type and first few items in both; long strings (chat
templates) are truncated only in the text output.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from ..constants import GGUFValueType
from ..reader import GGUFFile, StringArray

ARRAY_MAX = 8  # arrays longer than this are summarised...
ARRAY_HEAD = 4  # ...by their length, element type and this many first items
STRING_MAX = 80  # the text output truncates longer strings to this many characters and names their length


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="show a GGUF file's header, metadata and tensor types",
        description="Show a GGUF file's header, metadata, per-type tensor summary, parameter count and bits per "
        "weight. Opening any part of a split model shows the whole model.",
    )
    p.add_argument("file", metavar="FILE", help="a GGUF file, or a packaged model's short name: smollm2, gemma3")
    p.add_argument("--json", action="store_true", help="print one JSON document (always with the full tensor list)")
    p.add_argument("--tensors", action="store_true", help="also print the full tensor table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .. import open as open_gguf
    from ..loading import resolve_model_path

    with open_gguf(resolve_model_path(args.file)) as f:
        report = describe(f)
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        print(format_text(report, tensors=args.tensors))
    return 0


# --- gathering the facts ----------------------------------------------------------------------------------


def describe(f: GGUFFile) -> dict[str, Any]:
    """Everything `inspect` shows, as plain JSON-ready values."""
    parts = [
        {"path": str(p.path), "size": p.size, "data_offset": p.data_offset, "tensor_count": p.n_tensors}
        for p in f.parts
    ]
    types: dict[str, dict[str, Any]] = {}
    for t in f.tensors.values():
        s = types.setdefault(t.type.name, {"tensors": 0, "bytes": 0, "parameters": 0})
        s["tensors"] += 1
        s["bytes"] += t.nbytes
        s["parameters"] += t.n_elements
    for s in types.values():
        s["bits_per_weight"] = _bpw(s["bytes"], s["parameters"])
    types = dict(sorted(types.items(), key=lambda kv: -kv[1]["bytes"]))
    total_bytes = sum(s["bytes"] for s in types.values())
    total_params = sum(s["parameters"] for s in types.values())
    arch = f.architecture
    return {
        "paths": [p["path"] for p in parts],
        "version": f.version,
        "alignment": f.alignment,
        "tensor_count": len(f.tensors),
        "kv_count": len(f.metadata),
        "file_size": sum(p["size"] for p in parts),
        "parts": parts,
        "architecture": arch,
        "name": f.metadata.get("general.name"),
        "block_count": f.metadata.get(f"{arch}.block_count"),
        "metadata": {k: _json_value(v, f.value_types[k]) for k, v in f.metadata.items()},
        "metadata_types": {k: t.name for k, t in f.value_types.items()},
        "types": types,
        "parameters": total_params,
        "parameters_human": human_count(total_params),
        "tensor_bytes": total_bytes,
        "bits_per_weight": _bpw(total_bytes, total_params),
        "experts": experts(f, total_params),
        "tensors": [
            {
                "name": t.name,
                "type": t.type.name,
                "shape": list(t.shape),
                "bytes": t.nbytes,
                "parameters": t.n_elements,
                "offset": t.offset,
                "part": t.part,
            }
            for t in f.tensors.values()
        ],
    }


def experts(f: GGUFFile, total_params: int) -> dict[str, Any] | None:
    """A mixture of experts' sizes (llama.cpp LLM_KV_EXPERT_* keys), or None for a dense model. Each token runs
    `used` of the `count` experts of the stacked `*_exps` tensors: the rest of their parameters sit idle."""
    arch = f.architecture
    count = f.metadata.get(f"{arch}.expert_count")
    if not count:
        return None
    used = f.metadata.get(f"{arch}.expert_used_count")
    stacked = sum(t.n_elements for t in f.tensors.values() if t.name.rsplit(".", 1)[0].endswith("_exps"))
    active = total_params - stacked + stacked * (used or 0) // count
    return {
        "count": count,
        "used": used,
        "feed_forward_length": f.metadata.get(f"{arch}.expert_feed_forward_length"),
        "shared_feed_forward_length": f.metadata.get(f"{arch}.expert_shared_feed_forward_length"),
        "shared_count": f.metadata.get(f"{arch}.expert_shared_count"),
        "active_parameters": active,
        "active_parameters_human": human_count(active),
    }


def _bpw(nbytes: int, n_elements: int) -> float:
    return round(8 * nbytes / n_elements, 4) if n_elements else 0.0


def _json_value(value: Any, vtype: GGUFValueType | None = None) -> Any:
    """A metadata value as plain JSON: long arrays become {"length", "element_type", "head"}."""
    if isinstance(value, (list, np.ndarray, StringArray)):
        long = len(value) > ARRAY_MAX
        items = [_json_value(v) for v in _elements(value[:ARRAY_HEAD] if long else value)]
        return {"length": len(value), "element_type": element_type(value), "head": items} if long else items
    if vtype == GGUFValueType.FLOAT32 or isinstance(value, np.float32):
        # The reader widens FLOAT32 to a Python float (1e-05 reads as 9.999999747378752e-06); print the
        # shortest decimal that reads back as the same float32.
        return float(str(np.float32(value)))
    return value


def _elements(value: list | np.ndarray) -> list:
    if not isinstance(value, np.ndarray):
        return value
    # tolist() would widen float32 items to float64; keep them as np.float32 so _json_value can shorten them
    return list(value) if value.dtype == np.float32 else value.tolist()


def element_type(value: list | np.ndarray) -> str:
    """A short name for an array's element type: `f32`, `i32`, `u8`, `bool` for the NumPy arrays the reader
    returns for long numeric arrays; `str`, `int`, `float`, `bool`, `array` for the lists it returns otherwise."""
    if isinstance(value, np.ndarray):
        return "bool" if value.dtype == np.bool_ else f"{value.dtype.kind}{8 * value.dtype.itemsize}"
    if not value:
        return "?"
    return "array" if isinstance(value[0], (list, np.ndarray)) else type(value[0]).__name__


def human_count(n: int) -> str:
    """134515008 -> '134.5M'."""
    for div, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def human_bytes(n: int) -> str:
    """98362432 -> '93.8 MiB'."""
    for div, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


# --- text output ------------------------------------------------------------------------------------------


def format_text(report: dict[str, Any], tensors: bool = False) -> str:
    """The human-readable report: header, metadata, per-type summary and, with `tensors`, the tensor table."""
    lines = _header(report)
    lines += ["", f"metadata ({report['kv_count']} keys)"]
    lines += [f"  {k}: {format_value(v)}" for k, v in report["metadata"].items()]
    lines += ["", "tensor types"]
    lines += _type_table(report)
    lines += [
        "",
        f"parameters: {report['parameters_human']} ({report['parameters']:,})",
        f"bits per weight: {report['bits_per_weight']:.2f} ({report['tensor_bytes']:,} tensor bytes)",
    ]
    if report["experts"]:
        e = report["experts"]
        lines.insert(-1, f"active per token: {e['active_parameters_human']} ({e['active_parameters']:,})")
    if tensors:
        lines += ["", f"tensors ({report['tensor_count']}; shapes in NumPy order, outermost first)"]
        lines += _tensor_table(report)
    return "\n".join(lines)


def _header(r: dict[str, Any]) -> list[str]:
    rows = []
    if len(r["parts"]) == 1:
        rows.append(("file", r["paths"][0]))
    else:
        rows.append(("parts", str(len(r["parts"]))))
    rows += [
        ("version", str(r["version"])),
        ("alignment", str(r["alignment"])),
        ("tensors", str(r["tensor_count"])),
        ("metadata", f"{r['kv_count']} keys"),
        ("file size", f"{r['file_size']:,} bytes ({human_bytes(r['file_size'])})"),
    ]
    if len(r["parts"]) == 1:
        rows.append(("data offset", f"{r['parts'][0]['data_offset']:,}"))
    for label, key in (("architecture", "architecture"), ("name", "name"), ("blocks", "block_count")):
        if r[key] is not None:
            rows.append((label, str(r[key])))
    if r["experts"]:
        e = r["experts"]
        widths = [f"width {e['feed_forward_length']}"] if e["feed_forward_length"] else []
        if e["shared_feed_forward_length"]:
            widths.append(f"shared expert width {e['shared_feed_forward_length']}")
        rows.append(("experts", f"{e['count']}, {e['used']} used per token" + "".join(f", {w}" for w in widths)))
    lines = [f"{k + ':':<14}{v}" for k, v in rows]
    if len(r["parts"]) > 1:
        lines.append("")
        lines += _table(
            ["part", "path", "bytes", "data offset", "tensors"],
            [
                [str(i + 1), p["path"], f"{p['size']:,}", f"{p['data_offset']:,}", str(p["tensor_count"])]
                for i, p in enumerate(r["parts"])
            ],
            right={0, 2, 3, 4},
        )
    return lines


def format_value(value: Any) -> str:
    """One metadata value on one line: `[49152 x str] ['<|endoftext|>', ...]`, long strings cut with their length."""
    if isinstance(value, dict):  # a long array, summarised by _json_value
        head = ", ".join(_short(v) for v in value["head"])
        return f"[{value['length']} x {value['element_type']}] [{head}, ...]"
    if isinstance(value, list):
        return f"[{len(value)} x {element_type(value)}] [{', '.join(_short(v) for v in value)}]"
    return _short(value)


def _short(value: Any) -> str:
    if isinstance(value, str) and len(value) > STRING_MAX:
        return f"{value[:STRING_MAX]!r}... ({len(value)} chars)"
    if isinstance(value, (list, dict)):
        return format_value(value)
    return repr(value)


def _type_table(r: dict[str, Any]) -> list[str]:
    rows = [
        [name, str(s["tensors"]), f"{s['bytes']:,}", human_count(s["parameters"]), f"{s['bits_per_weight']:.2f}"]
        for name, s in r["types"].items()
    ]
    rows.append(
        [
            "total",
            str(r["tensor_count"]),
            f"{r['tensor_bytes']:,}",
            r["parameters_human"],
            f"{r['bits_per_weight']:.2f}",
        ]
    )
    return _table(["type", "tensors", "bytes", "parameters", "bpw"], rows, right={1, 2, 3, 4})


def _tensor_table(r: dict[str, Any]) -> list[str]:
    split = len(r["parts"]) > 1
    head = ["name", "type", "shape", "bytes"] + (["part"] if split else [])
    rows = [
        [t["name"], t["type"], " x ".join(map(str, t["shape"])), f"{t['bytes']:,}"]
        + ([str(t["part"] + 1)] if split else [])
        for t in r["tensors"]
    ]
    return _table(head, rows, right={3, 4})


def _table(head: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]

    def line(row: list[str]) -> str:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return "  " + "  ".join(cells).rstrip()

    return [line(head), *map(line, rows)]
