"""`--quantize fp8` against float16 on a GPU: the same weights, the same clips, error
rates and how many transcripts are identical (issue 38's accuracy gate).

    python -m bench.fp8_accuracy --out OUT [--multilingual DIR ...]
    python -m bench.fp8_accuracy --device cpu --systems float32 fp8 --out OUT   # emulated, slowly

Sets (`bench.beam_wer`'s readers):
- english: the packaged tiny.en on every recording of tests/data/audio (the 53 s sonnet
  long-form), language "en";
- english-base: the same recordings on the packaged base (`--checkpoint base`), language "en";
- multilingual: base on tests/data/multilingual and the `--multilingual` folders
  (../shared/audio/multilingual by default), the language detected.
Systems (SYSTEMS): `Pipeline.load(checkpoint, device="cuda")` as shipped (float16), with
`Quantization.FP8` (bfloat16 beside the FP8 products), and variants that show where
fp8's differences come from (bfloat16 alone, some products left in bfloat16, an erf form
in GELU (a polynomial, or libdevice's) instead of the shipped tanh form, or that form as a sigmoid, the cross-attention cache in bfloat16
rather than FP8: `EngineSetup.fp8_cross_kv`), and systems transcribing with
openai-whisper's `hallucination_silence_threshold`. Every other clip is transcribed with
the library's defaults, as the server does: greedy with temperature fallback,
timestamps, the previous text as prompt. `--device cpu` runs the systems on the CPU, the
FP8 products emulated (`fp8_emulated_on`), against float32 there.

The gate: each set's WER and CER within GATE_POINTS (0.3 points, absolute) of the
reference's (the first system, float16 by default). Writes `<out>/fp8-accuracy.json` and `.md`; `--plot JSON` draws the plot
from a written record (where matplotlib is).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.beam_wer import MULTILINGUAL, Clip, english_clips, multilingual_clips, score
from bench.markdown import markdown_table
from bench.paired_clips import INTERVAL, PairedClips, clip_word_edits, paired
from loadtest.provenance import REPO_ROOT, provenance

GATE_POINTS = 0.3
REFERENCE = "float16"
PER_LANGUAGE = 10  # every multilingual recording of the shared set (at most 8 per language there)

@dataclass(frozen=True)
class System:
    """How one system loads. dtype: the model's; fp8: FP8 products run; kept: which of them
    stay in bfloat16 (None: every one `Whisper.quantize_fp8` quantizes; "cross": the
    decoder's cross K/V projections; "edges": the first and last two encoder layers);
    gelu: how GELU inside the FP8 quantization is computed (`fp8_linear.GELU`; None: as
    shipped, the tanh form), e.g. libdevice's erf, as F.gelu does; fp8_cross_kv: whether
    the cross-attention K/V are kept in FP8 (`EngineSetup.fp8_cross_kv`; None: as the
    quantization ships, in FP8 with fp8); encoder_kernel: the kernel of the encoder's
    self-attention (`EngineSetup.encoder_kernel`, an `EncoderKernel` value; None: as
    shipped, FlashInfer's with fp8); silence_threshold: transcribe with word
    timestamps and this `hallucination_silence_threshold` (openai-whisper's rule for
    text invented in silence; None: the defaults, without either); fast_accumulation:
    True sums the FP8 products of up to `fp8_linear.FAST_ACCUMULATION_TRIED` inputs
    without float32 promotion (`fp8_linear.FAST_ACCUMULATION_MAX_INPUTS`; None: as
    shipped, every product promoted)."""

    dtype: str
    fp8: bool = False
    kept: str | None = None
    gelu: str | None = None  # a `fp8_linear.GeluForm` member's name
    fp8_cross_kv: bool | None = None
    encoder_kernel: str | None = None
    silence_threshold: float | None = None
    fast_accumulation: bool | None = None


# The shipped `--quantize fp8` is "fp8"; the others measure where its differences come from.
SYSTEMS = {
    "float16": System("float16"),
    "float32": System("float32"),  # the reference on the CPU (`--device cpu`)
    "bfloat16": System("bfloat16"),
    "fp8": System("bfloat16", fp8=True),
    "fp8, cross K/V in bfloat16": System("bfloat16", fp8=True, kept="cross"),
    "fp8, first and last two encoder layers in bfloat16": System("bfloat16", fp8=True, kept="edges"),
    "fp8, libdevice's erf": System("bfloat16", fp8=True, gelu="LIBDEVICE_ERF"),
    "fp8, polynomial erf": System("bfloat16", fp8=True, gelu="POLYNOMIAL_ERF"),  # shipped before the tanh form
    "fp8, tanh GELU": System("bfloat16", fp8=True, gelu="TANH"),  # the shipped form, named (the records of its trial)
    "fp8, tanh by the GPU's approximation": System("bfloat16", fp8=True, gelu="TANH_APPROX"),
    "fp8, tanh GELU as a sigmoid": System("bfloat16", fp8=True, gelu="SIGMOID"),
    "fp8, tanh GELU as a sigmoid, fast division": System("bfloat16", fp8=True, gelu="SIGMOID_FAST_DIVIDE"),
    "fp8, bfloat16 cross-attention cache": System("bfloat16", fp8=True, fp8_cross_kv=False),
    "fp8, SDPA encoder attention": System("bfloat16", fp8=True, encoder_kernel="sdpa"),  # as fp8 shipped before FA3
    "fp8, fast accumulation": System("bfloat16", fp8=True, fast_accumulation=True),
    # fp8's repeated line at the end of the sonnet is text invented after the speech ends:
    # whether openai-whisper's rule drops it, against the reference with the same rule.
    "float16, hallucination_silence_threshold 1": System("float16", silence_threshold=1.0),
    "float32, hallucination_silence_threshold 1": System("float32", silence_threshold=1.0),
    "fp8, hallucination_silence_threshold 1": System("bfloat16", fp8=True, silence_threshold=1.0),
}


@contextlib.contextmanager
def keeping(kept: str | None):
    """`Whisper.quantize_fp8` leaving some products in bfloat16, while loading."""
    from python_backend_lib.engine.model import Whisper

    shipped = Whisper.quantize_fp8

    def partly(model) -> None:
        last = len(model.encoder.layers) - 1
        edges = frozenset({0, 1, last - 1, last}) if kept == "edges" else frozenset()
        shipped(model, keep_encoder_layers=edges, cross_kv=kept != "cross")

    Whisper.quantize_fp8 = shipped if kept is None else partly
    try:
        yield
    finally:
        Whisper.quantize_fp8 = shipped


@contextlib.contextmanager
def kernels_of(system: str):
    """`fp8_linear.GELU` and `fp8_linear.FAST_ACCUMULATION_MAX_INPUTS` as `system` wants
    them, while it loads and decodes (each launch reads them, and the captured graphs
    keep what their capture read)."""
    from python_backend_lib.engine import fp8_linear

    chosen = SYSTEMS[system]
    shipped = fp8_linear.GELU, fp8_linear.FAST_ACCUMULATION_MAX_INPUTS
    if chosen.gelu is not None:
        fp8_linear.GELU = fp8_linear.GeluForm[chosen.gelu]
    if chosen.fast_accumulation:
        fp8_linear.FAST_ACCUMULATION_MAX_INPUTS = fp8_linear.FAST_ACCUMULATION_TRIED
    try:
        yield
    finally:
        fp8_linear.GELU, fp8_linear.FAST_ACCUMULATION_MAX_INPUTS = shipped


@contextlib.contextmanager
def fp8_emulated_on(device: str):
    """On the CPU, let `--quantize fp8` load, its products then computed by PyTorch's CPU
    `_scaled_mm` from the same FP8 values and scales (the GPU kernels' definitions,
    `fp8_linear.*_reference`), the rest of the model in bfloat16: slow, and rounding
    otherwise than a GPU's kernels, but the same kind of model. The server refuses it."""
    from python_backend_lib.core import quantization
    from python_backend_lib.engine import fp8_linear

    shipped = fp8_linear.problem, quantization.GPU_ONLY
    if device == "cpu":
        fp8_linear.problem = lambda device, dtype: None
        quantization.GPU_ONLY = quantization.GPU_ONLY - {quantization.Quantization.FP8}
    try:
        yield
    finally:
        fp8_linear.problem, quantization.GPU_ONLY = shipped


def transcriber(source: str, system: str, given_language: bool, device: str = "cuda"):
    import torch

    from python_backend_lib.core.encoder_kernel import EncoderKernel
    from python_backend_lib.core.options import DecodingOptions, TranscribeOptions
    from python_backend_lib.core.quantization import Quantization
    from python_backend_lib.engine.loading import EngineSetup
    from python_backend_lib.transcription.pipeline import Pipeline

    chosen = SYSTEMS[system]
    quantization = Quantization.FP8 if chosen.fp8 else Quantization.NONE
    with keeping(chosen.kept), fp8_emulated_on(device):
        pipeline = Pipeline.load(source, device=device, dtype=getattr(torch, chosen.dtype),
                                 setup=EngineSetup(quantization=quantization, fp8_cross_kv=chosen.fp8_cross_kv,
                                                   encoder_kernel=chosen.encoder_kernel and EncoderKernel(chosen.encoder_kernel)))
    silence = {} if chosen.silence_threshold is None else {
        "word_timestamps": True, "hallucination_silence_threshold": chosen.silence_threshold}

    def transcribe(clip: Clip) -> tuple[str, str | None]:
        decoding = DecodingOptions(timestamps=True, language=clip.language if given_language else None)
        transcript = pipeline.transcribe(clip.path.read_bytes(), TranscribeOptions(decoding=decoding, **silence))
        return transcript.text.strip(), transcript.language

    return transcribe, pipeline.close


def run_set(name: str, source: str, clips: list[Clip], given_language: bool, systems: list[str], say,
            device: str = "cuda") -> dict:
    """Every system on the set; systems[0] is the reference the others are compared with."""
    say(f"{name}: {len(clips)} clips, checkpoint {source}")
    scored = {}
    for system in systems:
        with kernels_of(system):
            transcribe, close = transcriber(source, system, given_language, device)
            try:
                scored[system] = score(system, clips, transcribe, lambda message: None)
            finally:
                close()
        say(f"  {system}: WER {scored[system].wer:.4f}, CER {scored[system].cer:.4f} in {scored[system].seconds} s")
    reference = scored[systems[0]]
    compared = {}
    for system, result in scored.items():
        wer_points, cer_points = 100 * (result.wer - reference.wer), 100 * (result.cer - reference.cer)
        compared[system] = {
            "identical": sum(a == b for a, b in zip(reference.transcripts, result.transcripts)),
            "wer_points": round(wer_points, 3), "cer_points": round(cer_points, 3),
            "within_gate": wer_points <= GATE_POINTS and cer_points <= GATE_POINTS,
        }
        say(f"  {system}: identical {compared[system]['identical']} of {len(clips)}; "
            f"WER {wer_points:+.2f} points, CER {cer_points:+.2f} points")
    return {
        "set": name, "checkpoint": source, "clips": [str(c.path.relative_to(c.path.parents[1])) for c in clips],
        "references": [c.reference for c in clips], "clip_languages": [c.language for c in clips],
        "systems": {k: asdict(v) for k, v in scored.items()},
        "reference_system": systems[0], "against_reference": compared,
    }


def compared(result_set: dict) -> dict:
    """A set's systems against its reference (records before the reference was named: float16)."""
    return result_set.get("against_reference") or result_set["against_float16"]


def by_clip(result_set: dict) -> dict[str, PairedClips]:
    """Each system against the set's reference, clip by clip (`bench.paired_clips`); none
    for a set recorded without its clips' languages."""
    languages = result_set.get("clip_languages")
    if languages is None:
        return {}
    reference = result_set.get("reference_system", REFERENCE)

    def counted(system: str) -> list[tuple[int, int]]:
        return clip_word_edits(result_set["references"], result_set["systems"][system]["transcripts"], languages)

    names = [Path(clip).name for clip in result_set["clips"]]
    against = counted(reference)
    return {system: paired(names, against, counted(system))
            for system in result_set["systems"] if system != reference}


BY_CLIP_HEADER = ["set", "system", "words", "points a word", "word edits more", "WER points", "clips changed",
                  "the clip that moved most", "WER points without it", f"{INTERVAL:.0%} of the clips resampled"]


def by_clip_rows(result_set: dict) -> list[list]:
    """BY_CLIP_HEADER's rows of one set."""
    return [[result_set["set"], system, p.words, f"{p.point_per_word:.2f}", f"{p.edit_difference:+d}",
             f"{p.wer_points:+.2f}", f"{p.changed} of {len(result_set['clips'])}",
             f"{p.largest.clip} ({p.largest.edits:+d})", f"{p.without_largest_points:+.2f}",
             f"{p.interval_points[0]:+.2f} to {p.interval_points[1]:+.2f}"]
            for system, p in by_clip(result_set).items()]


def report(record: dict) -> str:
    provenance_ = record["provenance"]
    lines = [
        f"# FP8 against {record['sets'][0].get('reference_system', REFERENCE)}: error rates on real weights", "",
        f"{provenance_['machine'].get('gpu')}, {provenance_['machine'].get('cpu_count')} CPUs; commit "
        f"{provenance_['commit']} (dirty: {provenance_['dirty']}), {provenance_['date']}; "
        f"`{provenance_['command']}`.", "",
        "| set | checkpoint | clips | system | WER | CER | WER points | CER points | identical to the reference "
        "| within 0.3 points |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in record["sets"]:
        for system, result in s["systems"].items():
            c = compared(s)[system]
            lines.append(
                f"| {s['set']} | {s['checkpoint']} | {result['clips']} | {system} | {result['wer']:.4f} | "
                f"{result['cer']:.4f} | {c['wer_points']:+.2f} | {c['cer_points']:+.2f} | "
                f"{c['identical']} of {result['clips']} | {'yes' if c['within_gate'] else 'no'} |"
            )
    lines += ["", "Greedy with fallback, timestamps, the library's defaults (as served). Transcripts "
              "are in the JSON record.", ""]
    rows = [row for s in record["sets"] for row in by_clip_rows(s)]
    if rows:
        lines += ["Clip by clip against the reference (`bench.paired_clips`): how far one word moves each "
                  "set, and how much of the difference one clip makes.", "",
                  markdown_table(BY_CLIP_HEADER, rows), ""]
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    """Each set's WER and CER, the reference beside the other systems."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = record["sets"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, metric in zip(axes, ("wer", "cer")):
        systems = list(sets[0]["systems"])
        width = 0.8 / len(systems)
        for k, system in enumerate(systems):
            ax.bar([i - 0.4 + (k + 0.5) * width for i in range(len(sets))],
                   [s["systems"][system][metric] for s in sets], width, label=system)
        ax.set_xticks(range(len(sets)), [f"{s['set']}\n({s['checkpoint']})" for s in sets])
        ax.set_ylabel(metric.upper())
    axes[0].legend(fontsize=7)
    fig.suptitle(f"FP8 against {sets[0].get('reference_system', REFERENCE)}, same weights and clips")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--multilingual", type=Path, nargs="*", default=list(MULTILINGUAL[1:]),
                        help="folders with a manifest.tsv besides tests/data/multilingual")
    parser.add_argument("--sets", nargs="+", default=["english", "english-base", "multilingual"])
    parser.add_argument("--systems", nargs="+", default=[REFERENCE, "fp8"], choices=list(SYSTEMS),
                        help="what to compare, the first the reference (default: float16, then fp8)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: FP8 products emulated with PyTorch (`fp8_emulated_on`); compare with float32 there")
    parser.add_argument("--plot", type=Path, help="only draw the plot of this written record")
    args = parser.parse_args(argv)
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return 0
    start = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {message}", flush=True)

    folders = (REPO_ROOT / "tests" / "data" / "multilingual", *args.multilingual)
    sets = {
        "english": ("default", english_clips(), True),
        "english-base": ("base", english_clips(), True),
        "multilingual": ("base", multilingual_clips(PER_LANGUAGE, folders), False),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"provenance": provenance(), "gate_points": GATE_POINTS, "sets": []}
    for name in args.sets:
        source, clips, given = sets[name]
        record["sets"].append(run_set(name, source, clips, given, args.systems, say, args.device))
        (args.out / "fp8-accuracy.json").write_text(json.dumps(record, indent=1, ensure_ascii=False))
    (args.out / "fp8-accuracy.md").write_text(report(record))
    say(f"wrote {args.out}")
    return 0 if all(s["against_reference"].get("fp8", {"within_gate": True})["within_gate"] for s in record["sets"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
