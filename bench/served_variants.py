"""One model served several ways, one after another in one run: the same clips, the same clients.

    python -m bench.served_variants --model tiny --out OUT \
        --variant before=checkout:.before --variant host=log_mel_output:host --variant device=log_mel_output:device

Each `--variant LABEL=KEY:VALUE[,KEY:VALUE...]` is a server:
- checkout:DIR    the code of another checkout (an earlier commit: `git archive` of its
                  python_backend_lib/, model_repository/ and clients/, with the commit in
                  DIR/COMMIT), served as that commit served;
- log_mel_output:host|device, preprocessing:COUNT[:KIND], postprocessing:COUNT[:KIND],
  whisper:COUNT[:KIND]   a copy of this checkout's repository so changed (`repository_copy`);
- mps:on|off      `serve --mps on|off` (with a checkout too; default: the launcher's auto);
- quantize:MODE   `serve --quantize MODE` (e.g. fp8; with a checkout too; default: the config's);
- encoder_attention:sdpa|flashinfer   a copy of this checkout's repository whose whisper model
                  runs the encoder's self-attention so (`core.encoder_kernel`);
- word_timestamps:on   every request asks for word timestamps (each window then pays the
                  engine thread one alignment pass: what live hypotheses ask; with a checkout too).

For each, in turn: `whisper-triton serve --gpus GPU`, one ~5 s clip at concurrency 1
(`--latency-s`), then each of `--concurrency`. Every answer is judged against the
library's transcript of its clip (`bench.references`). Writes served-variants.json,
.md (a table per variant and the best of each) and .png into `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.comparisons import add_common_options, best_point, described_run, header, plot_rtfx, prepare
from bench.jobs import Job
from bench.load import LoadGenerator, PointPlan
from bench.repository_copy import Instances, copy_repository, instance_group, repository_with_instances, set_parameters
from bench.served import POINT_MARGIN_S, STATE_DIR, Settings, describe_point, latency_job, measure_point
from bench.server_process import ServeCommand, ServerProcess, checkout_record
from python_backend_lib.contract import tensor_names
from python_backend_lib.core.encoder_kernel import EncoderKernel
from python_backend_lib.core.quantization import Quantization

RESULTS = "served-variants.json"
INSTANCE_MODELS = (tensor_names.PREPROCESSING_NAME, tensor_names.WHISPER_NAME, tensor_names.POSTPROCESSING_NAME)


def say(message: str) -> None:
    print(f"[bench.served_variants {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass(frozen=True)
class Variant:
    label: str
    spec: str  # as given
    checkout: Path | None = None
    log_mel_output: str | None = None
    instances: dict[str, Instances] = field(default_factory=dict)
    mps: bool | None = None
    quantize: str | None = None
    whisper_parameters: dict[str, str] = field(default_factory=dict)  # set in the whisper model's config
    request_parameters: dict[str, object] = field(default_factory=dict)  # added to every request

    def jobs(self, jobs: list[Job]) -> list[Job]:
        """The benchmark's requests as this variant sends them."""
        if not self.request_parameters:
            return jobs
        return [dataclasses.replace(j, parameters={**j.parameters, **self.request_parameters}) for j in jobs]


def parse_variant(text: str) -> Variant:
    """LABEL=KEY:VALUE[,KEY:VALUE...] (module docstring), as argparse's `type`."""
    label, _, spec = text.partition("=")
    checkout, output, instances, mps, quantize, whisper_parameters = None, None, {}, None, None, {}
    request_parameters: dict[str, object] = {}
    try:
        for item in filter(None, spec.split(",")):
            key, _, value = item.partition(":")
            if key == "checkout":
                checkout = Path(value)
            elif key == "log_mel_output" and value in ("host", "device"):
                output = value
            elif key == "mps" and value in ("on", "off"):
                mps = value == "on"
            elif key == "quantize" and value in {q.value for q in Quantization}:
                quantize = value
            elif key == "encoder_attention" and value in {k.value for k in EncoderKernel}:
                whisper_parameters[key] = value
            elif key == "word_timestamps" and value == "on":
                request_parameters[key] = True
            elif key in INSTANCE_MODELS:
                instances.update([instance_group(f"{key}={value}")])
            else:
                raise ValueError(item)
    except (ValueError, argparse.ArgumentTypeError) as error:
        raise argparse.ArgumentTypeError(f"bad --variant {text!r}: {error}; see python -m bench.served_variants -h")
    if not label or (checkout and (output or instances or whisper_parameters)):
        raise argparse.ArgumentTypeError(f"bad --variant {text!r}: a label, and a checkout alone or changes alone")
    return Variant(label, spec, checkout, output, instances, mps, quantize, whisper_parameters, request_parameters)


def repository_for(variant: Variant) -> Path | None:
    """The model repository a variant serves (None: the checkout's own, or this one's as shipped)."""
    changed = variant.log_mel_output is not None or variant.instances or variant.whisper_parameters
    if variant.checkout is not None or not changed:
        return None
    directory = STATE_DIR / f"variant-{variant.label}"
    if variant.instances:
        repository_with_instances(variant.instances, directory)
    else:
        copy_repository(directory)
    if variant.log_mel_output:
        set_parameters(directory, {tensor_names.PREPROCESSING_NAME: {"log_mel_output": variant.log_mel_output}})
    if variant.whisper_parameters:
        set_parameters(directory, {tensor_names.WHISPER_NAME: variant.whisper_parameters})
    return directory


def run_variant(variant: Variant, checkpoint: str, jobs: list[Job], args, settings: Settings, deadline: float) -> dict:
    jobs = variant.jobs(jobs)
    command = ServeCommand(checkpoint, repository_for(variant), args.gpus, checkout=variant.checkout, mps=variant.mps,
                           quantize=variant.quantize)
    log_path = args.out / f"variant-{variant.label}.log"
    record: dict = {"label": variant.label, "spec": variant.spec, "command": command.display, "points": [],
                    "log": log_path.name}
    record.update(checkout_record(variant.checkout))
    say(f"{variant.label}: starting {command.display}")
    with ServerProcess(command, log_path, settings.startup_s) as server:
        record["ready_s"] = server.ready_s
        job = latency_job(jobs)
        with LoadGenerator(command.grpc_url, [job.load_request()], processes=1) as load:
            load.run(PointPlan(1, 0.0, settings.warmup_s, settings.timeout_s))  # warm-up
            _, point = measure_point(load, PointPlan(1, 0.0, args.latency_s, settings.timeout_s), command.grpc_url)
            record["latency_5s"] = {"clip": job.describe(), **point}
            say(describe_point(f"{variant.label} [{job.audio.clip.name}]", point))
        with LoadGenerator(command.grpc_url, [j.load_request() for j in jobs], processes=args.clients) as load:
            for concurrency in args.concurrency:
                if deadline - time.monotonic() < settings.warmup_s + settings.point_s + POINT_MARGIN_S:
                    record["stopped"] = f"out of time before concurrency {concurrency}"
                    break
                plan = PointPlan(concurrency, settings.warmup_s, settings.point_s, settings.timeout_s)
                _, point = measure_point(load, plan, command.grpc_url)
                record["points"].append(point)
                say(describe_point(variant.label, point) + f", server {point['server_cores']}")
    return record


def markdown(data: dict) -> str:
    lines = [f"# {data['model']} served several ways, one run (`--gpus {data['gpus']}`)", "",
             described_run(data), "",
             "| variant | best good req/s | RTFx there | concurrency | mean clip served (s) | answers equal to the "
             "library's | 5 s clip alone: p50 / p99 ms |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for record in data["variants"]:
        top, alone = best_point(record), record.get("latency_5s")
        if top is None:
            lines.append(f"| {record['label']} | {record.get('error', 'no point')} | | | | | |")
            continue
        lines.append(f"| {record['label']} (`{record['spec']}`) | {top['goodput_per_s']} | {top['rtfx']} | "
                     f"{top['concurrency']} | {top['mean_clip_s']} | {top['exact']} of {top['compared']} | "
                     + (f"{alone['latency_ms']['p50']} / {alone['latency_ms']['p99']} |" if alone else " |"))
    lines += ["", "Every point:", "", "| variant | concurrency | good req/s | RTFx | p50 ms | p99 ms | not OK | "
              "server cores by role (busiest process) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for record in data["variants"]:
        for p in record["points"]:
            refused = {k: v for k, v in p["statuses"].items() if k != "OK"}
            roles = ", ".join(f"{role} {r['cores']} ({r['busiest']})" for role, r in p["server_cores"].items())
            lines.append(f"| {record['label']} | {p['concurrency']} | {p['goodput_per_s']} | {p['rtfx']} | "
                         f"{p['latency_ms']['p50']} | {p['latency_ms']['p99']} | {refused or ''} | {roles} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.served_variants", description=__doc__.split("\n\n")[0])
    add_common_options(parser)
    parser.add_argument("--variant", type=parse_variant, action="append", required=True, metavar="LABEL=SPEC")
    parser.add_argument("--gpus", default="0", help="`serve --gpus` for every variant")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--latency-s", type=float, default=10.0, help="the 5 s clip at concurrency 1, this long")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    prepared = prepare(args, say)
    settings, checkpoint, jobs = prepared.settings, prepared.checkpoint, prepared.jobs
    data = {**header("bench.served_variants", args, jobs, argv), "gpus": args.gpus, "variants": []}
    say(f"{len(jobs)} clips, mean {data['mean_clip_s']} s; variants {[v.label for v in args.variant]}")
    for index, variant in enumerate(args.variant):
        share_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(args.variant) - index)
        try:
            data["variants"].append(run_variant(variant, checkpoint, jobs, args, settings, share_deadline))
        except Exception as error:  # keep the other variants' records
            data["variants"].append({"label": variant.label, "spec": variant.spec, "points": [],
                                     "error": f"{type(error).__name__}: {error}"})
            say(f"{variant.label} failed: {error}")
        (args.out / RESULTS).write_text(json.dumps(data, indent=1))
    (args.out / "served-variants.md").write_text(markdown(data))
    plot_rtfx([(r["label"], r["points"]) for r in data["variants"]],
              f"{data['model']} served several ways, {data['run']['machine']['gpu']}", args.out / "served-variants.png")
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
