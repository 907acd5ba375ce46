"""The FP8 encoder's memory-bound kernels alone, at large-v3's shapes: the input
quantization (`fp8_linear.quantize_rows`) per launch setting and, for fc2's input, per form
of its GELU (`fp8_linear.GeluForm`), and a layer norm that hands
its product a quantized input (`fp8_linear.norm_quantize`) against the separate
addition, layer norm and quantization it replaces.

    python -m bench.fp8_kernels --windows 16 --out /tmp/fp8-kernels

Rows are the encoder's positions of `--windows` windows (1,500 each). Each case is timed
by `bench.kernel_timing.microseconds`; the figure is microseconds a launch and the bytes
it must move (read once, written once) a second. Writes
`<out>/fp8-kernels.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench.kernel_timing import microseconds
from loadtest.provenance import provenance
from python_backend_lib.engine import fp8_linear

CUDA = torch.device("cuda")
POSITIONS = 1500
WIDTH = 1280  # large-v3's
ELEMENTS = (2048, 4096, 8192)
WARPS = (4, 8, 16)


def say(message: str) -> None:
    print(f"[bench.fp8_kernels {time.strftime('%H:%M:%S')}] {message}", flush=True)


def record(case: str, us: float, moved_bytes: int, **settings) -> dict:
    result = {"case": case, **settings, "us": round(us, 1), "gb_per_s": round(moved_bytes / us / 1e3, 1)}
    say(f"{case:34s} {settings} {us:9.1f} us {result['gb_per_s']:8.1f} GB/s")
    return result


def quantization_sweep(rows: int) -> list[dict]:
    """Each input width, without GELU and with each of its forms (`fp8_linear.GeluForm`;
    the shipped form's case is named "gelu", the others "gelu, <form>")."""
    results, shipped = [], fp8_linear.GELU
    cases = [(WIDTH, None), (4 * WIDTH, None), *((4 * WIDTH, form) for form in fp8_linear.GeluForm)]
    for cols, form in cases:
        x = torch.randn(rows, cols, device=CUDA, dtype=torch.bfloat16)
        moved = rows * cols * 3  # bfloat16 in, FP8 out
        fp8_linear.GELU = shipped if form is None else form
        name = f"quantize {cols}" + ("" if form is None else " gelu" if form is shipped else f" gelu, {form.name.lower()}")
        for elements in ELEMENTS:
            for warps in WARPS:
                fp8_linear.QUANTIZE_ELEMENTS, fp8_linear.QUANTIZE_WARPS = elements, warps
                us = microseconds(lambda: fp8_linear.quantize_rows(x, gelu=form is not None))
                results.append(record(name, us, moved, elements=elements, warps=warps))
    fp8_linear.GELU = shipped
    return results


def norm_comparison(rows: int, elements: int, warps: int) -> list[dict]:
    fp8_linear.QUANTIZE_ELEMENTS, fp8_linear.NORM_WARPS = elements, warps
    norm = nn.LayerNorm(WIDTH, device=CUDA, dtype=torch.bfloat16)
    x = torch.randn(rows, WIDTH, device=CUDA, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    element_bytes = rows * WIDTH * 2
    cases = {
        "layer norm, then quantize": (lambda: fp8_linear.quantize_rows(F.layer_norm(x, (WIDTH,), norm.weight, norm.bias)),
                                      element_bytes * 3.5),
        "norm_quantize": (lambda: fp8_linear.norm_quantize(x, norm), element_bytes * 1.5),
        "add, layer norm, then quantize": (
            lambda: fp8_linear.quantize_rows(F.layer_norm(x + residual, (WIDTH,), norm.weight, norm.bias)),
            element_bytes * 6.5),
        "norm_quantize with the residual": (lambda: fp8_linear.norm_quantize(x, norm, residual), element_bytes * 3.5),
    }
    return [record(case, microseconds(run), int(moved), elements=elements, warps=warps)
            for case, (run, moved) in cases.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = args.windows * POSITIONS
    torch.manual_seed(0)
    shipped = fp8_linear.QUANTIZE_ELEMENTS, fp8_linear.QUANTIZE_WARPS, fp8_linear.NORM_WARPS
    sweep = quantization_sweep(rows)
    norm = [result for elements in (2048, 4096, 8192) for warps in (4, 8)
            for result in norm_comparison(rows, elements, warps)]
    fp8_linear.QUANTIZE_ELEMENTS, fp8_linear.QUANTIZE_WARPS, fp8_linear.NORM_WARPS = shipped
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"provenance": provenance(), "rows": rows, "width": WIDTH, "shipped": dict(zip(("elements", "warps", "norm_warps"), shipped)),
            "quantization": sweep, "norm": norm}
    (args.out / "fp8-kernels.json").write_text(json.dumps(data, indent=1) + "\n")
    say(f"wrote {args.out / 'fp8-kernels.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
