"""One model of the ensemble called alone, at rising concurrency: what each request costs
it, and what its queue does when requests come faster than it answers.

    python -m bench.model_alone --model postprocessing --concurrency 256 2048 --requests 20000 --out OUT

`whisper-triton serve` (on this machine's device) serves the packaged repository, or
`--model-repository`. One clip (`--clip`) goes through `preprocessing` and `whisper`
alone once; then the model's inputs for that clip (the audio file for
`preprocessing`, its decoded tensors for `postprocessing`) go to the model from one
asyncio gRPC client, keeping `--concurrency` requests in flight, each with a timeout,
until `--requests` were sent. A refused request is replaced by the next at once, as a
load generator's clients do. Each point records answered and refused requests (by
reason), Triton's batches for the model (requests per `execute`, its mean time in
`execute` and queued), and the CPU the model's stubs and tritonserver spent per
answered request. For `postprocessing` it also times the library's own part of a request
in this process (`library_ms`: the transcript made from the same decoded tensors and its
three outputs written, as the stub makes them), to set beside Triton's `execute` time.

Writes `<model>-alone.json` and prints a line per point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.host import ServerProcesses
from bench.load import error_reason
from bench.server_process import ServeCommand, ServerProcess
from bench.triton_stats import model_stats, stats_delta
from loadtest.provenance import provenance
from python_backend_lib.contract import tensor_names

AUDIO = Path(__file__).resolve().parents[1] / "tests" / "data" / "audio"
MODELS = (tensor_names.PREPROCESSING_NAME, tensor_names.POSTPROCESSING_NAME)
REQUEST_TIMEOUT_S = 120.0
DECODED = {  # whisper's outputs that postprocessing reads, with their Triton types
    tensor_names.TOKENS: "INT32",
    tensor_names.WINDOWS: "FP64",
    tensor_names.ALIGNMENT: "FP64",
    tensor_names.LANGUAGE: "INT32",
    tensor_names.LANGUAGE_PROBABILITY: "FP64",
}


LIBRARY_CALLS = 500  # timed calls of the library's part, after as many again to warm it


def say(message: str) -> None:
    print(f"[bench.model_alone {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Point:
    concurrency: int
    sent: int
    seconds: float
    answered: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    answered_per_s: float = 0.0
    requests_per_execute: float = 0.0
    execute_ms: float = 0.0  # Triton's mean time of one request in execute(): its batch's
    queue_ms: float = 0.0
    stub_cpu_ms_per_request: float = 0.0
    tritonserver_cpu_ms_per_request: float = 0.0


def model_inputs(url: str, model: str, clip: Path) -> list[tuple[str, np.ndarray, str]]:
    """One clip's inputs of `model`: the file for preprocessing; for postprocessing, what
    `preprocessing` and `whisper` called alone give for it."""
    import tritonclient.grpc as grpc

    wav = (tensor_names.AUDIO, np.array([[clip.read_bytes()]], dtype=object), "BYTES")
    if model == tensor_names.PREPROCESSING_NAME:
        return [wav]
    client = grpc.InferenceServerClient(url)
    try:
        audio = grpc.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
        audio.set_data_from_numpy(wav[1])
        features = client.infer(tensor_names.PREPROCESSING_NAME, [audio], client_timeout=REQUEST_TIMEOUT_S)
        inputs = []
        for name, dtype in ((tensor_names.LOG_MEL, "FP32"), (tensor_names.SAMPLES, "INT64")):
            array = features.as_numpy(name)
            inputs.append(grpc.InferInput(name, list(array.shape), dtype))
            inputs[-1].set_data_from_numpy(array)
        decoded = client.infer(tensor_names.WHISPER_NAME, inputs, client_timeout=REQUEST_TIMEOUT_S)
    finally:
        client.close()
    return [(name, decoded.as_numpy(name), dtype) for name, dtype in DECODED.items()] + [
        (tensor_names.SAMPLES, features.as_numpy(tensor_names.SAMPLES), "INT64")]


def library_ms(inputs: list[tuple[str, np.ndarray, str]]) -> float:
    """The median milliseconds of postprocessing's library part for these inputs (a request
    without parameters, as this bench sends, and the packaged checkpoint's tokenizer, which
    the server serves unless `--model-repository` says otherwise): what its `execute` does
    besides reading the request and writing the response through Triton."""
    from python_backend_lib.checkpoints.configs import load_config
    from python_backend_lib.contract.decoded_tensors import DecodedTensors
    from python_backend_lib.contract.parameters import parse_request_parameters
    from python_backend_lib.serving.inputs import single_row
    from python_backend_lib.serving.postprocessing_service import transcript_document
    from python_backend_lib.serving.responses import transcript_outputs
    from python_backend_lib.text.tokenizer import load_tokenizer

    arrays = {name: single_row(array, name) for name, array, _ in inputs}
    tensors = DecodedTensors.of(arrays.__getitem__)
    samples = int(arrays[tensor_names.SAMPLES][0])
    tokenizer = load_tokenizer(load_config("default"))

    def once() -> None:
        parameters = parse_request_parameters({})
        document = transcript_document(tensors, samples, None, parameters.transcription, tokenizer)
        transcript_outputs(document, parameters.response_format)

    times = []
    for call in range(2 * LIBRARY_CALLS):
        start = time.perf_counter()
        once()
        if call >= LIBRARY_CALLS:
            times.append(1000 * (time.perf_counter() - start))
    return round(float(np.median(times)), 4)


async def send(url: str, model: str, inputs: list[tuple[str, np.ndarray, str]], concurrency: int, total: int) -> Point:
    import tritonclient.grpc.aio as grpc_aio

    client = grpc_aio.InferenceServerClient(url)
    point = Point(concurrency, total, 0.0)
    left = iter(range(total))

    async def one_slot() -> None:
        for _ in left:
            request = []
            for name, array, dtype in inputs:
                request.append(grpc_aio.InferInput(name, list(array.shape), dtype))
                request[-1].set_data_from_numpy(array)
            try:
                await client.infer(model, request, client_timeout=REQUEST_TIMEOUT_S)
                point.answered += 1
            except Exception as error:  # refused or failed: counted by reason
                reason = error_reason(str(error))
                point.refused[reason] = point.refused.get(reason, 0) + 1

    started = time.monotonic()
    try:
        await asyncio.gather(*(one_slot() for _ in range(concurrency)))
    finally:
        point.seconds = round(time.monotonic() - started, 3)
        await client.close()
    return point


def measure(server: ServerProcess, model: str, inputs, concurrency: int, total: int) -> Point:
    url = server.command.grpc_url
    processes = ServerProcesses.find(server.command.ports["grpc"])
    cpu_before, stats_before = processes.cpu_seconds(), model_stats(url)
    point = asyncio.run(send(url, model, inputs, concurrency, total))
    cpu_after, stats = processes.cpu_seconds(), stats_delta(stats_before, model_stats(url))
    busy = processes.busy(cpu_before, cpu_after, point.seconds)
    counted = stats.get(model, {})
    answered = max(point.answered, 1)
    point.answered_per_s = round(point.answered / point.seconds, 1)
    point.requests_per_execute = round(counted.get("requests", 0) / max(counted.get("executions", 0), 1), 1)
    point.execute_ms, point.queue_ms = counted.get("execute_ms", 0.0), counted.get("queue_ms", 0.0)
    for role, attribute in ((model, "stub_cpu_ms_per_request"),
                            ("tritonserver", "tritonserver_cpu_ms_per_request")):
        cores = busy.get(role, {}).get("cores", 0.0)
        setattr(point, attribute, round(1000 * cores * point.seconds / answered, 3))
    return point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.model_alone", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default=tensor_names.POSTPROCESSING_NAME)
    parser.add_argument("--clip", type=Path, default=AUDIO / "jfk.wav", help="the audio file the requests carry")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--requests", type=int, default=20000, help="requests sent at each concurrency")
    parser.add_argument("--model-repository", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    command = ServeCommand(None, args.model_repository)
    points = []
    with ServerProcess(command, args.out / f"{args.model}-alone-server.log", 300.0) as server:
        inputs = model_inputs(command.grpc_url, args.model, args.clip)
        library = library_ms(inputs) if args.model == tensor_names.POSTPROCESSING_NAME else None
        if library is not None:
            say(f"the library's part of a request, in this process: {library} ms (median of {LIBRARY_CALLS})")
        asyncio.run(send(command.grpc_url, args.model, inputs, 64, 2000))  # warm-up
        for concurrency in args.concurrency:
            point = measure(server, args.model, inputs, concurrency, args.requests)
            points.append(point)
            say(f"concurrency {concurrency}: {point.answered} answered ({point.answered_per_s}/s), refused "
                f"{sum(point.refused.values())}; {point.requests_per_execute} requests an execute of "
                f"{point.execute_ms} ms, queued {point.queue_ms} ms; CPU ms a request: stubs "
                f"{point.stub_cpu_ms_per_request}, tritonserver {point.tritonserver_cpu_ms_per_request}")
    command_line = "python -m bench.model_alone " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / f"{args.model}-alone.json").write_text(json.dumps(
        {"run": provenance(), "command": command_line, "model": args.model, "clip": args.clip.name,
         "repository": str(args.model_repository or "packaged"), "library_ms": library,
         "points": [asdict(p) for p in points]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
