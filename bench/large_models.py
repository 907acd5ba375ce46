"""The big checkpoints' record (issue 38): the served runs, the encoder's pass and fp8's
accuracy, from their benchmarks' JSON files, as one record with its table and plot.

    python -m bench.large_models --out docs/benchmarks/large-models \
        --served OUT/sv/served-variants.json OUT/svt/served-variants.json \
        --encoder "645f790=BEFORE/enc/encoder-cost.json" "44d0e55=OUT/enc/encoder-cost.json" \
        --accuracy "44d0e55=OUT/acc/fp8-accuracy.json" "645f790=BEFORE/acc/fp8-accuracy.json" \
        --kernels "44d0e55=OUT/k/fp8-kernels.json" --profile "bced14a=OUT/p/engine-profile.json" \
        --cross "4a0f538=OUT/cross/cross-attention.json" --engine-runs "GELU forms=RUNS.json" \
        --products "b63c111=OUT/prod/fp8-products.json"
    python -m bench.large_models --out docs/benchmarks/large-models \
        --from-record docs/benchmarks/large-models/large-models.json     # drawn again

Inputs: `bench.served_variants` runs (one per model), `bench.encoder_cost` runs,
`bench.fp8_accuracy` runs and, optionally, `bench.fp8_kernels`, `bench.fp8_products`,
`bench.engine_profile`, `bench.cross_attention`, `bench.encoder_attention` and
`bench.encoder_sustained` runs, and engine runs known only by the RTFx line each
printed (`--engine-runs`), each labelled (LABEL=PATH: the code and conditions it
measured). A served variant's code is its checkout's commit, or the commit the call
ran. Writes large-models.json (the inputs, keyed), large-models.md and large-models.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.comparisons import best_point
from bench.encoder_sustained import SUMMARY_HEADER, summary_row
from bench.fp8_accuracy import BY_CLIP_HEADER, by_clip_rows, compared
from bench.markdown import markdown_table
from bench.server_process import checkout_label

# Issue 38's targets: served RTFx on one GPU, through the ensemble.
TARGETS = {"large-v3": 1000, "large-v3-turbo": 1500}
PROFILED_BATCH = 16


def served_rows(served: list[dict]) -> list[list]:
    rows = []
    for run in served:
        for variant in run["variants"]:
            top, alone = best_point(variant), variant["latency_5s"]["latency_ms"]
            # A variant whose server took its whole share of the run to start has no load point.
            load = (top["rtfx"], top["goodput_per_s"], top["concurrency"]) if top else ("not measured", "–", "–")
            rows.append([run["model"], variant["label"], checkout_label(variant, 12) or run["run"]["commit"][:7],
                         *load, f"{alone['p50']} / {alone['p99']}", TARGETS[run["model"]]])
    return rows


def encoder_rows(encoders: dict[str, dict]) -> list[list]:
    rows = []
    for label, encoder in encoders.items():
        for run in encoder["runs"]:
            by_size = {s["batch"]: s for s in run["sizes"]}
            one, many = by_size.get(1), by_size[PROFILED_BATCH]  # a run of --sizes 16 alone has no single clip
            rows.append([label, run["model"], run["variant"], one["ms_per_window"] if one else "–", many["ms_per_pass"],
                         many["ms_per_window"], many["tflops"]])
    return rows


def larger_pass_rows(encoders: dict[str, dict]) -> list[list]:
    """Passes of more than PROFILED_BATCH clips, which the engine does not capture
    (`bench.encoder_cost --sizes`), beside each run's pass of PROFILED_BATCH."""
    rows = []
    for label, encoder in encoders.items():
        for run in encoder["runs"]:
            sizes = [s for s in run["sizes"] if s["batch"] >= PROFILED_BATCH]
            if any(s["batch"] > PROFILED_BATCH for s in sizes):
                rows += [[label, run["model"], run["variant"], s["batch"], s["ms_per_pass"], s["ms_per_window"],
                          s["tflops"]] for s in sizes]
    return rows


def larger_pass_section(encoders: dict[str, dict]) -> list[str]:
    rows = larger_pass_rows(encoders)
    if not rows:
        return []
    return [f"Passes of more than {PROFILED_BATCH} clips (the engine captures up to {PROFILED_BATCH}):", "",
            markdown_table(["code", "model", "variant", "clips", "ms a pass", "ms a window", "TFLOP/s"], rows), ""]


def kernel_rows(encoders: dict[str, dict]) -> tuple[list[str], list[list]]:
    runs = [(label, run) for label, encoder in encoders.items() for run in encoder["runs"]]
    kinds = sorted({kind for _, run in runs for kind in run["kernels_at_largest_ms"]})
    rows = [[label, run["model"], run["variant"], *(run["kernels_at_largest_ms"].get(kind, 0.0) for kind in kinds)]
            for label, run in runs]
    return kinds, rows


def accuracy_rows(accuracies: dict[str, dict]) -> list[list]:
    rows = []
    for label, accuracy in accuracies.items():
        for s in accuracy["sets"]:
            for system, result in s["systems"].items():
                c = compared(s)[system]
                rows.append([label, s["set"], s["checkpoint"], system, f"{result['wer']:.4f}", f"{result['cer']:.4f}",
                             f"{c['wer_points']:+.2f}", f"{c['cer_points']:+.2f}",
                             f"{c['identical']} of {result['clips']}"])
    return rows


def kernel_timing_rows(kernels: dict[str, dict]) -> list[list]:
    """Each `bench.fp8_kernels` case: microseconds a launch at the settings its commit
    shipped, and at the sweep's best settings."""
    rows = []
    for label, record in kernels.items():
        shipped = record["shipped"]
        for part, warps in (("quantization", shipped["warps"]), ("norm", shipped.get("norm_warps", shipped["warps"]))):
            by_case: dict[str, list[dict]] = {}
            for result in record[part]:
                by_case.setdefault(result["case"], []).append(result)
            for case, results in by_case.items():
                at_shipped = next((r for r in results if r["elements"] == shipped["elements"] and r["warps"] == warps), None)
                best = min(results, key=lambda r: r["us"])
                rows.append([label, case, at_shipped["us"] if at_shipped else "–", best["us"],
                             f"{best['elements']} elements, {best['warps']} warps", best["gb_per_s"]])
    return rows


def machine(record: dict) -> str:
    m = record["machine"]
    return f"{m['gpu'] or 'no GPU'}, {m['cpu_count']} CPUs ({m['cpu']}), torch {m['torch']}"


def markdown(data: dict) -> str:
    served, encoders, accuracies = data["served"], data["encoder"], data["accuracy"]
    kinds, kernels = kernel_rows(encoders)
    first_encoder = next(iter(encoders.values()))
    return "\n".join([
        "# The big checkpoints: served, the encoder's pass, fp8's accuracy", "",
        f"Served and encoder runs: {machine(served[0]['run'])}. Random weights of the real shapes; every request "
        "decodes round(2.728 x its length) text tokens (tiny.en's measured rate), 96 clips of 0.5 to 29.9 s "
        "(mean 5.48 s), four client processes; a label ending in -2 is the same variant again, later in the same "
        "call or in the next call on the same machine (the spread between runs). Commands: "
        + "; ".join(f"`{run['command']}`" for run in served) + ".", "",
        "## Served through the ensemble, at the point of most good requests a second", "",
        markdown_table(["model", "variant", "code", "RTFx", "good req/s", "concurrency", "a 5 s clip alone, p50 / p99 ms",
                        "target RTFx"], served_rows(served)), "",
        f"## The encoder's pass (encoder and cross K/V), one clip and {PROFILED_BATCH} together", "",
        f"{machine(first_encoder['provenance'])}; " + "; ".join(
            f"{label}: `{encoder['provenance']['command']}`" for label, encoder in encoders.items()) + ".", "",
        markdown_table(["code", "model", "variant", "ms a window, 1 clip", f"ms a pass of {PROFILED_BATCH}",
                        f"ms a window, {PROFILED_BATCH} clips", f"TFLOP/s at {PROFILED_BATCH}"], encoder_rows(encoders)), "",
        *larger_pass_section(encoders),
        f"Device milliseconds of one pass of {PROFILED_BATCH} windows by kind of kernel:", "",
        markdown_table(["code", "model", "variant", *kinds], kernels), "",
        *sustained_section(data.get("sustained", {})),
        *kernel_section(data.get("kernels", {})),
        *products_section(data.get("products", {})),
        *profile_section(data.get("profiles", {})),
        *cross_section(data.get("cross", {})),
        *encoder_attention_section(data.get("encoder_attention", {})),
        *engine_runs_section(data.get("engine_runs", {})),
        "## fp8 against float16 on real weights (greedy with fallback, as served)", "",
        "; ".join(f"{label}: {machine(accuracy['provenance'])}, `{accuracy['provenance']['command']}`"
                  for label, accuracy in accuracies.items()) + ". Points and identical transcripts are against "
        "each set's reference, its first system (float16 on a GPU, float32 on the CPU).", "",
        markdown_table(["code", "set", "checkpoint", "system", "WER", "CER", "WER points", "CER points",
                        "identical to the reference"], accuracy_rows(accuracies)), "",
        "The same transcripts clip by clip (`bench.paired_clips`): how far one word edit moves each set's WER, "
        "the clip whose edits moved most against the reference, the difference without it, and the "
        "difference's spread over sets of the same clips resampled with replacement.", "",
        markdown_table(["code", *BY_CLIP_HEADER],
                       [[label, *row] for label, accuracy in accuracies.items()
                        for s in accuracy["sets"] for row in by_clip_rows(s)]), "",
        *notes_section(data),
    ])


def notes_section(data: dict) -> list[str]:
    """The notes an input carries (a record's code that its commit alone does not say)."""
    notes = [f"- {run['model']}, {run['run']['date']}: {run['note']}" for run in data["served"] if run.get("note")]
    notes += [f"- {label}: {record['note']}" for key in ("accuracy", "products") for label, record in data.get(key, {}).items()
              if record.get("note")]
    return ["## Notes on the inputs", "", *notes, ""] if notes else []


def sustained_section(sustained: dict[str, dict]) -> list[str]:
    """`bench.encoder_sustained` runs: a pass alone against held busy, the clock meanwhile."""
    if not sustained:
        return []
    first = next(iter(sustained.values()))
    return [
        "## The encoder's pass held busy: the clock, not gaps", "",
        f"{machine(first['provenance'])}; " + "; ".join(
            f"{label}: `{record['provenance']['command']}`" for label, record in sustained.items())
        + ". Passes alone each follow 2 s without work; back to back, each is timed between its own events; "
        "nvidia-smi sampled each phase every 50 ms; the profiled replays ran back to back.", "",
        markdown_table(["code", *SUMMARY_HEADER], [[label, *summary_row(record["run"])]
                                                   for label, record in sustained.items()]), "",
    ]


def kernel_section(kernels: dict[str, dict]) -> list[str]:
    if not kernels:
        return []
    first = next(iter(kernels.values()))
    return [
        f"## The FP8 encoder's memory-bound kernels alone, {first['rows']:,} rows (16 large-v3 windows)", "",
        f"{machine(first['provenance'])}; " + "; ".join(
            f"{label}: `{record['provenance']['command']}`" for label, record in kernels.items()) + ".", "",
        markdown_table(["code", "case", "us a launch, as shipped", "us a launch, best", "best settings",
                        "GB/s at best"], kernel_timing_rows(kernels)), "",
    ]


def products_section(products: dict[str, dict]) -> list[str]:
    """`bench.fp8_products` runs: each way of scaling an encoder product, its speed and error."""
    if not products:
        return []
    first = next(iter(products.values()))
    rows = [[label, r["windows"], r["product"], r["case"], r["us"], r["tflops"], f"{r['relative_error']:.2e}",
             f"{r['norm_error']:.2e}" if "norm_error" in r else "–"]
            for label, record in products.items() for r in record["results"] if "us" in r]
    failed = sorted({f"{r['case']} ({r['failed'].splitlines()[0][:120]})"
                     for record in products.values() for r in record["results"] if "failed" in r})
    return [
        "## The encoder's matrix products alone, each way of scaling FP8 (large-v3's shapes)", "",
        f"{machine(first['provenance'])}; " + "; ".join(
            f"{label}: `{record['provenance']['command']}`" for label, record in products.items())
        + ". Rows are 1,500 a window; the error is the largest difference from float32 sums of the same FP8 "
        "values and scales over the largest magnitude (and the norm of the differences over the norm); row-wise "
        "is the shipped scaling." + (f" Not run: {'; '.join(failed)}." if failed else ""), "",
        markdown_table(["code", "windows", "product", "case", "us", "TFLOP/s", "error", "error of the norm"], rows), "",
    ]


def profile_section(profiles: dict[str, dict]) -> list[str]:
    """`bench.engine_profile` runs: the wall's shares and each stream's kernels by kind."""
    if not profiles:
        return []
    first = next(iter(profiles.values()))
    shares = list(first["percent_of_wall"])
    rows = [[label, p["model"], p["quantize"], p["rtfx_unprofiled"], p["rtfx_profiled"], p["decode_steps"],
             p["mean_rows_a_step"], *(p["percent_of_wall"][share] for share in shares)] for label, p in profiles.items()]
    kinds = []
    for label, p in profiles.items():
        one_stream = not p["kernel_ms"]["side"]  # before the side stream: encoder and decoder on one
        for stream, by_kind in p["kernel_ms"].items():
            for kind, ms in by_kind.items():
                if one_stream:
                    kinds.append([label, "one stream (encoder and decoder)", kind, ms, "–"])
                elif stream == "side":
                    kinds.append([label, "side (admissions)", kind, ms, f"{ms / p['clips']:.2f} ms a window"])
                else:
                    kinds.append([label, "decoding", "attention, other kernels" if kind == "attention" else kind, ms,
                                  f"{ms / max(1, p['decode_steps']):.2f} ms a step"])
    return [
        f"## Where a saturated engine's time goes: {first['clips']} requests, {first['concurrency']} in flight", "",
        f"{machine(first['provenance'])}; the engine alone (`Pipeline`, no Triton), random weights, the same "
        "forced lengths; one run each under PyTorch's profiler, its kernels cut by stream (code that runs every "
        "kernel on one stream shows it all as decoder steps). " + "; ".join(
            f"{label}: `{p['provenance']['command']}`" for label, p in profiles.items()) + ".", "",
        markdown_table(["code", "model", "precision", "RTFx", "RTFx profiled", "decoder steps", "rows a step",
                        *(f"% of the wall: {share}" for share in shares)], rows), "",
        "Kernel time by stream and kind (the decoder's FlashInfer decode kernels split into self- and "
        "cross-attention by their order in each layer):", "",
        markdown_table(["code", "stream", "kernels", "ms in all", "each"], kinds), "",
    ]


def cross_section(crosses: dict[str, dict]) -> list[str]:
    """`bench.cross_attention` runs: the decoder's cross-attention kernel alone, per way of storing the K/V."""
    if not crosses:
        return []
    first = next(iter(crosses.values()))
    rows = [[label, r["case"]["rows"], r["case"]["kv_dtype"], r["case"]["layout"], r["case"]["page_size"],
             ("tensor cores" if r["case"]["tensor_cores"] else "CUDA cores")
             + (", from a CUDA graph" if r["case"].get("graph") else ""), r["us"], r["read_gb_per_s"],
             r["copy_gb_per_s"]] for label, record in crosses.items() for r in record["results"]]
    return [
        f"## The cross-attention decode kernel alone ({first['positions']:,} positions, {first['heads']} heads of "
        f"{first['head_dim']})", "",
        f"{machine(first['provenance'])}; FlashInfer's batch decode, one query a row; " + "; ".join(
            f"{label}: `{record['provenance']['command']}`" for label, record in crosses.items())
        + ". The K/V bytes the kernel must read a second, against a plain copy of as many bytes on the same GPU "
        "(read and written).", "",
        markdown_table(["code", "rows", "K/V", "layout", "page", "kernel", "us a launch", "GB/s read",
                        "a copy's GB/s"], rows), "",
    ]


def encoder_attention_section(records: dict[str, dict]) -> list[str]:
    """`bench.encoder_attention` runs: the encoder's self-attention kernel alone, each way
    with its error against float32."""
    if not records:
        return []
    first = next(iter(records.values()))
    rows = [[label, r["windows"], r["way"], "–" if r["us"] is None else r["us"],
             "–" if r["relative_error"] is None else r["relative_error"], r.get("error") or ""]
            for label, record in records.items() for r in record["results"]]
    return [
        f"## The encoder's self-attention alone ({first['positions']:,} positions, {first['heads']} heads of "
        f"{first['head_dim']})", "",
        f"{machine(first['provenance'])}; " + "; ".join(
            f"{label}: `{record['provenance']['command']}`" for label, record in records.items())
        + ". Random q, k and v in bfloat16; the error is the norm of the difference from float32 SDPA of the same "
        "inputs over the norm of that reference.", "",
        markdown_table(["code", "windows", "way", "us a call", "error against float32", "failure"], rows), "",
    ]


def engine_runs_section(engine_runs: dict[str, dict]) -> list[str]:
    """Runs of the engine alone known only by the RTFx line each printed (`bench.engine_profile`
    runs whose JSON did not come back from the device): each line kept as printed."""
    if not engine_runs:
        return []
    rows = [[label, r["variant"], r["code"], r["run"], r["rtfx"], f"`{r['command']}`"]
            for label, record in engine_runs.items() for r in record["runs"]]
    return [
        "## The engine alone, unprofiled, by the RTFx each run printed", "",
        "; ".join(f"{label}: {machine(record['provenance'])}, {record['provenance']['date']}, {record['source']}"
                  for label, record in engine_runs.items()) + ".", "",
        markdown_table(["runs", "variant", "code", "run", "RTFx", "command"], rows), "",
    ]


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in served_rows(data["served"]) if not isinstance(row[3], str)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.9 + 0.28 * len(rows)), gridspec_kw={"width_ratios": [1.2, 1]})
    labels = [f"{r[0].replace('large-v3-turbo', 'turbo')} {r[1]} ({r[2][:7]})" for r in rows]
    left.barh(range(len(rows)), [r[3] for r in rows],
              color=["#999" if r[1].startswith(("main", "before", "host", "sdpa")) else "#4477aa" for r in rows])
    for model, target in TARGETS.items():
        left.axvline(target, linestyle=":", color="#aa3377", linewidth=1)
        left.text(target, len(rows) - 0.4, f"{model} target", fontsize=7, ha="right", va="bottom", rotation=90)
    left.set_yticks(range(len(rows)), labels, fontsize=7)
    left.invert_yaxis()
    left.set_xlabel("served RTFx (grey: the code before each change)")
    for label, record in data["encoder"].items():
        for run in record["runs"]:
            if run["model"] != "large-v3":
                continue
            sizes = run["sizes"]
            right.plot([s["batch"] for s in sizes], [s["ms_per_window"] for s in sizes], marker="o",
                       label=f"{run['variant']} ({label})")
    right.set_xscale("log", base=2)
    right.set_xlabel("windows encoded together")
    right.set_ylabel("ms a window (large-v3)")
    right.legend(fontsize=7)
    fig.suptitle(f"large-v3 and turbo on {data['served'][0]['run']['machine']['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def labelled(text: str) -> tuple[str, Path]:
    """LABEL=PATH, as argparse's `type`."""
    label, separator, path = text.partition("=")
    if not separator or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH, not {text!r}")
    return label, Path(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--from-record", type=Path,
                        help="a large-models.json written before: its table and plot drawn again, no inputs read")
    parser.add_argument("--served", type=Path, nargs="+")
    parser.add_argument("--encoder", type=labelled, nargs="+", help="LABEL=PATH of bench.encoder_cost")
    parser.add_argument("--accuracy", type=labelled, nargs="+", help="LABEL=PATH of bench.fp8_accuracy")
    parser.add_argument("--kernels", type=labelled, nargs="*", default=[], help="LABEL=PATH of bench.fp8_kernels")
    parser.add_argument("--products", type=labelled, nargs="*", default=[], help="LABEL=PATH of bench.fp8_products")
    parser.add_argument("--profile", type=labelled, nargs="*", default=[], help="LABEL=PATH of bench.engine_profile")
    parser.add_argument("--sustained", type=labelled, nargs="*", default=[],
                        help="LABEL=PATH of bench.encoder_sustained")
    parser.add_argument("--cross", type=labelled, nargs="*", default=[], help="LABEL=PATH of bench.cross_attention")
    parser.add_argument("--encoder-attention", type=labelled, nargs="*", default=[],
                        help="LABEL=PATH of bench.encoder_attention")
    parser.add_argument("--engine-runs", type=labelled, nargs="*", default=[],
                        help="LABEL=PATH of engine runs known by their printed RTFx lines (engine_runs_section)")
    args = parser.parse_args(argv)

    def read(path: Path) -> dict:
        return json.loads(path.read_text(encoding="utf-8"))

    if args.from_record:
        data = read(args.from_record)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "large-models.md").write_text(markdown(data), encoding="utf-8")
        plot(data, args.out / "large-models.png")
        return 0
    if not (args.served and args.encoder and args.accuracy):
        parser.error("--served, --encoder and --accuracy are needed, unless --from-record")
    data = {"served": [read(p) for p in args.served], "encoder": {label: read(p) for label, p in args.encoder},
            "accuracy": {label: read(p) for label, p in args.accuracy},
            "kernels": {label: read(p) for label, p in args.kernels},
            "products": {label: read(p) for label, p in args.products},
            "profiles": {label: read(p) for label, p in args.profile},
            "cross": {label: read(p) for label, p in args.cross},
            "sustained": {label: read(p) for label, p in args.sustained},
            "encoder_attention": {label: read(p) for label, p in args.encoder_attention},
            "engine_runs": {label: read(p) for label, p in args.engine_runs}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "large-models.json").write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")
    (args.out / "large-models.md").write_text(markdown(data), encoding="utf-8")
    plot(data, args.out / "large-models.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
