"""The engine thread's per-row bookkeeping of an overlapped graph step, timed on the host alone.

    python -m bench.step_bookkeeping --rows 1 16 64 256
    (cd .before && PYTHONPATH=$REPO python -m bench.step_bookkeeping --rows 1 16 64 256)   # an earlier library

At saturation a step holds hundreds of rows and the engine thread, not the GPU, bounds a
small model (docs/performance.md). Some of its host work grows with the rows: planning the
next step (`overlap.plan_step`), writing in the tokens the device fed (`Launched.settle`),
and saving the rows before each step for a rewind (`DecodeBatch.checkpoint`, with the
earlier libraries' `Launched.remember_before`, which made the same states at every step).
This times those calls for steady greedy rows that follow themselves, no model and no
device involved: what changes between two libraries' versions of them, on the CPU that
runs it. The rest of a step (launching, reading the picks, handling them) is not here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

# A steady row: tiny.en's <|startoftranscript|>, a prompt fed, 19 tokens generated.
SOT, TIMESTAMP_BEGIN, GENERATED = 50257, 50364, 19
ROUNDS = 5


def steady_rows(n: int) -> list:
    from python_backend_lib.core.options import DecodingOptions
    from python_backend_lib.engine.prompt import Prompt
    from python_backend_lib.engine.rows import Row

    rows = []
    for i in range(n):
        row = Row(tag=object(), options=DecodingOptions(), prompt=Prompt((SOT,), 0, False, "en"), slot=i + 1,
                  max_new_tokens=224, pending=[5])  # fmt: skip
        row.cached, row.generated = GENERATED + 1, list(range(100, 100 + GENERATED))
        rows.append(row)
    return rows


def launched_from(launched_type, plan):
    """A launched step of `plan`, nothing on a device: earlier libraries' `Launched` also
    kept the facts the step ran with."""
    if "facts" in launched_type.__dataclass_fields__:
        return launched_type(plan.parts, plan.inputs.tokens.copy(), plan.inputs.facts.copy(), None)
    return launched_type(plan.parts, plan.inputs.tokens.copy(), None)


def settle(launched, previous, picked) -> None:
    """`Launched.settle`; earlier libraries' also moved the host's facts on from `previous`."""
    if "facts" in type(launched).__dataclass_fields__:
        launched.settle(previous, picked, TIMESTAMP_BEGIN)
    else:
        launched.settle(picked)


def time_calls(n: int, reps: int) -> dict[str, float]:
    """Microseconds a step (median of ROUNDS rounds of `reps`) for each call, with `n` rows."""
    from python_backend_lib.engine.batch import DecodeBatch
    from python_backend_lib.engine.graph_io import GraphStep
    from python_backend_lib.engine.overlap import Launched, plan_step

    rows = steady_rows(n)
    first = plan_step(rows, None, 8, TIMESTAMP_BEGIN)
    previous = launched_from(Launched, first)
    for row in rows:
        row.pending = []  # each follows itself from now on
    picked = GraphStep([200] * n, [-0.1] * n, [0.0] * n, None, None)
    plan = plan_step(rows, previous, 8, TIMESTAMP_BEGIN)
    launched = launched_from(Launched, plan)
    batch = types.SimpleNamespace(_in_flight=launched, rows=rows)  # what checkpoint reads of a DecodeBatch

    def save() -> None:
        if hasattr(launched, "remember_before"):  # earlier libraries made the states at every step
            launched.remember_before()
        DecodeBatch.checkpoint(batch)

    calls = {"plan": lambda: plan_step(rows, previous, 8, TIMESTAMP_BEGIN),
             "settle": lambda: settle(launched, previous, picked),
             "save for a rewind": save}  # fmt: skip
    timed = {}
    for name, call in calls.items():
        rounds = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for _ in range(reps):
                call()
            rounds.append(1e6 * (time.perf_counter() - start) / reps)
        timed[name] = round(statistics.median(rounds), 2)
    return timed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.step_bookkeeping", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--reps", type=int, default=2000, help="calls a round, divided by the rows beyond 16")
    parser.add_argument("--out", type=Path, help="a JSON file for the results")
    args = parser.parse_args(argv)
    import python_backend_lib

    library = str(Path(python_backend_lib.__file__).resolve().parents[1])
    results = {n: time_calls(n, max(10, args.reps * 16 // max(n, 16))) for n in args.rows}
    print(f"library at {library}: us a step")
    for n, timed in results.items():
        print(f"  {n:4d} rows: " + ", ".join(f"{name} {us}" for name, us in timed.items()), flush=True)
    record = {"library": library, "command": "python -m bench.step_bookkeeping " + " ".join(argv or sys.argv[1:]),
              "us_a_step": {str(n): timed for n, timed in results.items()}}  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
