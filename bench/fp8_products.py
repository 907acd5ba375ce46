"""The encoder's matrix products alone, at large-v3's shapes: how fast each way of
scaling an FP8 product runs, and how far each lands from the same FP8 values multiplied
in float32.

    python -m bench.fp8_products --windows 1 16 32 --out /tmp/fp8-products

The shipped way (`fp8_linear.fp8_linear`) scales each input row and each weight channel
(`torch._scaled_mm`, row-wise). Against it: bfloat16 (`F.linear`), one scale for the whole
input and one for the weight (tensor-wise, cuBLAS), Hopper's fast accumulation with
either, and blocks of 128 (a scale per row's 128 columns and per 128 x 128 block of the
weight, `F.scaled_mm`). Each case is timed by `bench.kernel_timing.microseconds`; its
error is the largest difference from the float32 product of the same values and scales,
over the float32 product's largest magnitude (and the differences' norm over its norm). Writes `<out>/fp8-products.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.kernel_timing import microseconds
from loadtest.provenance import provenance
from python_backend_lib.engine.fp8_linear import FP8, FP8_MAX, MIN_SCALE

CUDA = torch.device("cuda")
POSITIONS = 1500
WIDTH = 1280  # large-v3's
BLOCK = 128
# (name, out features, in features) of one encoder layer's products
PRODUCTS = (("qkv", 3 * WIDTH, WIDTH), ("out", WIDTH, WIDTH), ("fc1", 4 * WIDTH, WIDTH), ("fc2", WIDTH, 4 * WIDTH))


def say(message: str) -> None:
    print(f"[bench.fp8_products {time.strftime('%H:%M:%S')}] {message}", flush=True)


def quantize(x: torch.Tensor, scale_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] float32 -> FP8 values, float32 scales of one per block of
    rows // scale_shape[0] x cols // scale_shape[1] elements (max |x| / 448)."""
    rows, cols = x.shape
    blocks = x.reshape(scale_shape[0], rows // scale_shape[0], scale_shape[1], cols // scale_shape[1])
    scales = (blocks.abs().amax(dim=(1, 3), keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)  # as fp8_linear scales
    values = (blocks / scales).to(FP8).reshape(rows, cols)
    return values, scales.reshape(scale_shape)


def dequantized(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, cols = values.shape
    blocks = values.float().reshape(scales.shape[0], rows // scales.shape[0], scales.shape[1], cols // scales.shape[1])
    return (blocks * scales[:, None, :, None]).reshape(rows, cols)


def cases(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor]]:
    """Each case's call and the float32 product it approximates (of the same FP8 values)."""
    rows, k = x.shape
    n = w.shape[0]
    x_bf, w_bf, bias_bf = x.bfloat16(), w.bfloat16(), bias.bfloat16()
    out: dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor]] = {
        "bfloat16": (lambda: F.linear(x_bf, w_bf, bias_bf), F.linear(x_bf.float(), w_bf.float(), bias_bf.float())),
    }
    xr, sr = quantize(x, (rows, 1))
    wr, swr = quantize(w, (n, 1))
    reference = F.linear(dequantized(xr, sr), dequantized(wr, swr), bias_bf.float())
    for fast in (False, True):
        out["row-wise" + (", fast accumulation" if fast else "")] = (
            lambda fast=fast: torch._scaled_mm(xr, wr.t(), scale_a=sr, scale_b=swr.reshape(1, n), bias=bias_bf,
                                               out_dtype=torch.bfloat16, use_fast_accum=fast),
            reference)
    xt, st = quantize(x, (1, 1))
    wt, swt = quantize(w, (1, 1))
    reference = F.linear(dequantized(xt, st), dequantized(wt, swt), bias_bf.float())
    for fast in (False, True):
        out["tensor-wise" + (", fast accumulation" if fast else "")] = (
            lambda fast=fast: torch._scaled_mm(xt, wt.t(), scale_a=st.reshape(()), scale_b=swt.reshape(()), bias=bias_bf,
                                               out_dtype=torch.bfloat16, use_fast_accum=fast),
            reference)
    xb, sb = quantize(x, (rows, k // BLOCK))
    wb, swb = quantize(w, (n // BLOCK, k // BLOCK))
    reference = F.linear(dequantized(xb, sb), dequantized(wb, swb), None) + bias_bf.float()
    # cuBLAS reads the row blocks' scales with the rows fastest, the weight's with its
    # blocks of K fastest and their count a multiple of 4.
    scale_a = sb.t().contiguous().t()
    padded_k = -(-(k // BLOCK) // 4) * 4
    scale_b = torch.zeros(n // BLOCK, padded_k, device=CUDA)
    scale_b[:, : k // BLOCK] = swb
    scale_b = scale_b.t()

    def blockwise() -> torch.Tensor:
        return F.scaled_mm(xb, wb.t(), scale_a, F.ScalingType.BlockWise1x128, scale_b, F.ScalingType.BlockWise128x128,
                           output_dtype=torch.bfloat16) + bias_bf

    out["blocks of 128 (bias added after)"] = (blockwise, reference)
    return out


def measure(windows: int, name: str, n: int, k: int) -> list[dict]:
    rows = windows * POSITIONS
    torch.manual_seed(0)
    x = torch.randn(rows, k, device=CUDA)
    x[:, :: 97] *= 20  # a few columns of outliers, as activations have
    w = torch.randn(n, k, device=CUDA) / k**0.5
    bias = torch.randn(n, device=CUDA) * 0.1
    results = []
    for case, (run, reference) in cases(x, w, bias).items():
        try:
            difference = run().float() - reference
            error = (difference.abs().max() / reference.abs().max()).item()
            norm_error = (difference.norm() / reference.norm()).item()
            us = microseconds(run)
        except (RuntimeError, TypeError, ValueError) as failure:  # a way this build of torch lacks
            say(f"{windows:3d} windows {name:4s} {case:36s} failed: {str(failure).splitlines()[0][:160]}")
            results.append({"windows": windows, "product": name, "case": case, "failed": str(failure)[:400]})
            continue
        tflops = 2 * rows * n * k / us / 1e6
        say(f"{windows:3d} windows {name:4s} {case:36s} {us:9.1f} us {tflops:7.1f} TFLOP/s "
            f"error {error:.2e} (of the norm {norm_error:.2e})")
        results.append({"windows": windows, "product": name, "case": case, "us": round(us, 1),
                         "tflops": round(tflops, 1), "relative_error": error, "norm_error": norm_error})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    results = [result for windows in args.windows for name, n, k in PRODUCTS for result in measure(windows, name, n, k)]
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"provenance": provenance(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "results": results}
    (args.out / "fp8-products.json").write_text(json.dumps(data, indent=1) + "\n")
    say(f"wrote {args.out / 'fp8-products.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
