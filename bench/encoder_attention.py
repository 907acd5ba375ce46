"""The encoder's self-attention alone, at large-v3's shapes (turbo's encoder is the same):
what FP8 attention would save, before the engine is changed for it.

    python -m bench.encoder_attention --windows 1 16 --out /tmp/encoder-attention

Attention is the second largest part of an fp8 encoder pass after the matrix products
(docs/performance.md: 15.7 of 69.8 ms for 16 large-v3 windows, PyTorch's SDPA running
cuDNN's flash kernel in bfloat16). Each window attends over its own 1,500 positions,
every head, no mask. Ways, each timed on the same inputs (`bench.kernel_timing`):
- "sdpa": PyTorch's scaled_dot_product_attention in bfloat16, as the encoder runs it
  (`engine.attention.sdpa_encoder_attention`);
- "fa3": FlashInfer's ragged prefill in bfloat16 (its FA3 kernels on Hopper), as
  `EncoderKernel.FLASHINFER` runs it;
- "fa3 fp8": the same kernels reading q, k and v in FP8 E4M3, one scale per head
  (its largest magnitude / 448), writing bfloat16; "quantize" times the scaling and
  casting of q, k and v that it needs first (done by PyTorch here: a kernel of the
  engine's would fold it into the qkv product's epilogue).

For each way, its output's error against float32 SDPA of the same inputs (the norm of
the difference over the reference's), so that speed is read beside what it costs. The
inputs are random, scaled so that the logits spread as a trained encoder's do: this
measures kernels, not transcripts (`bench.fp8_accuracy` scores those). FlashInfer's FA3
modules compile on first use (minutes for the FP8 one, once per machine). Writes
`<out>/encoder-attention.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.kernel_timing import microseconds
from loadtest.provenance import provenance
from python_backend_lib.engine.attention import sdpa_encoder_attention
from python_backend_lib.engine.fp8_linear import FP8, quantize_weight

CUDA = torch.device("cuda")
POSITIONS, HEADS, HEAD_DIM = 1500, 20, 64  # large-v3's (and turbo's) encoder
WORKSPACE_BYTES = 256 * 1024 * 1024
# Random q and k of this spread give logits of a few units' spread, where softmax is
# neither uniform nor one-hot.
SPREAD = 1.5


@dataclass(frozen=True)
class Result:
    windows: int
    way: str
    us: float | None  # None where the way failed (`error` says why)
    relative_error: float | None  # against float32 SDPA
    error: str | None = None


def say(message: str) -> None:
    print(f"[bench.encoder_attention {time.strftime('%H:%M:%S')}] {message}", flush=True)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return round(((got.float() - want).norm() / want.norm()).item(), 5)


def per_head_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H, D] -> its FP8 values and one float32 scale per head (x = values * scale):
    each head's values as a weight's output channel (`fp8_linear.quantize_weight`)."""
    n, heads, dim = x.shape
    values, scales = quantize_weight(x.transpose(0, 1).reshape(heads, n * dim))
    return values.view(heads, n, dim).transpose(0, 1).contiguous(), scales.view(heads)


def ways(windows: int) -> list[Result]:
    import flashinfer

    generator = torch.Generator(device=CUDA).manual_seed(windows)
    q, k, v = (torch.randn(windows, POSITIONS, HEADS, HEAD_DIM, device=CUDA, generator=generator) * SPREAD
               for _ in range(3))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    want = sdpa_encoder_attention(q.float(), k.float(), v.float())
    flat = [t.reshape(windows * POSITIONS, HEADS, HEAD_DIM) for t in (q, k, v)]
    indptr = torch.arange(windows + 1, dtype=torch.int32) * POSITIONS
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=CUDA)
    results = []

    def timed(way: str, run, compared: bool = True) -> None:
        """`run` timed; its output ([windows * positions, heads, dim] or [B, T, H, D]) against
        the reference unless `compared` is False."""
        try:
            error = relative_error(run().reshape(want.shape), want) if compared else None
            results.append(Result(windows, way, round(microseconds(run), 2), error))
        except Exception as failure:  # a kernel this FlashInfer does not build: recorded, not fatal
            results.append(Result(windows, way, None, None, f"{type(failure).__name__}: {failure}"[:500]))
        say(f"{windows} windows, {way}: {results[-1]}")

    timed("sdpa", lambda: sdpa_encoder_attention(q, k, v))

    bf16 = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
    bf16.plan(indptr, indptr, HEADS, HEADS, HEAD_DIM, causal=False, q_data_type=torch.bfloat16,
              kv_data_type=torch.bfloat16)
    timed("fa3", lambda: bf16.run(*flat))

    (q8, q_scale), (k8, k_scale), (v8, v_scale) = (per_head_fp8(t) for t in flat)
    fp8 = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
    try:
        fp8.plan(indptr, indptr, HEADS, HEADS, HEAD_DIM, causal=False, q_data_type=FP8, kv_data_type=FP8,
                 o_data_type=torch.bfloat16)
    except Exception as failure:
        results.append(Result(windows, "fa3 fp8", None, None, f"plan: {type(failure).__name__}: {failure}"[:500]))
        say(f"{windows} windows, fa3 fp8: {results[-1]}")
    else:
        timed("fa3 fp8", lambda: fp8.run(q8, k8, v8, q_scale, k_scale, v_scale))
    timed("quantize q, k, v to fp8 (PyTorch)", lambda: [per_head_fp8(t) for t in flat], compared=False)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = [r for windows in args.windows for r in ways(windows)]
    data = {"provenance": provenance(), "device": torch.cuda.get_device_name(), "positions": POSITIONS,
            "heads": HEADS, "head_dim": HEAD_DIM, "results": [asdict(r) for r in results]}
    (args.out / "encoder-attention.json").write_text(json.dumps(data, indent=1) + "\n")
    say(f"wrote {args.out / 'encoder-attention.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
