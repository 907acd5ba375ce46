"""Triton's own per-model statistics: requests, executions, time queued and in execute()."""

from __future__ import annotations

import time

STATS_TIMEOUT_S = 20.0
# How long `settled_stats` waits for a quiet server's counts to agree, and between reads.
SETTLE_TIMEOUT_S = 5.0
SETTLE_POLL_S = 0.05


def model_stats(url: str) -> dict:
    """Cumulative statistics of every model, from the gRPC endpoint at `url`."""
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(url)
    try:
        stats = client.get_inference_statistics(as_json=True, client_timeout=STATS_TIMEOUT_S)
    finally:
        client.close()
    out = {}
    for model in stats.get("model_stats", []):
        inference = model.get("inference_stats", {})
        out[model["name"]] = {
            "requests": int(inference.get("success", {}).get("count", 0)),
            "failures": int(inference.get("fail", {}).get("count", 0)),
            "executions": int(model.get("execution_count", 0)),
            "queue_ns": int(inference.get("queue", {}).get("ns", 0)),
            "compute_ns": int(inference.get("compute_infer", {}).get("ns", 0)),
        }
    return out


def stats_delta(before: dict, after: dict) -> dict:
    """Per model between two readings: requests, failures, executions (batches), and the
    mean time a successful request queued and spent in execute(), in ms."""
    out = {}
    for name, now in after.items():
        then = before.get(name, {})
        requests = now["requests"] - then.get("requests", 0)
        failures = now.get("failures", 0) - then.get("failures", 0)
        if requests <= 0 and failures <= 0:
            continue
        out[name] = {
            "requests": requests,
            "failures": failures,
            "executions": now["executions"] - then.get("executions", 0),
            "queue_ms": round((now["queue_ns"] - then.get("queue_ns", 0)) / max(requests, 1) / 1e6, 3),
            "execute_ms": round((now["compute_ns"] - then.get("compute_ns", 0)) / max(requests, 1) / 1e6, 3),
        }
    return out


def agree(stats: dict) -> bool:
    """Whether every model that answered a request has answered as many as the others,
    as on a quiet server whose requests each went through every model once."""
    return len({m["requests"] + m["failures"] for m in stats.values() if m["requests"] + m["failures"]}) <= 1


def settled_stats(url: str, timeout_s: float = SETTLE_TIMEOUT_S) -> dict:
    """`model_stats` of a server with no request in flight, once its counts agree. Triton
    counts a request after its model has answered it: the client can have its answer, and
    start the next reading, before the last model (and the ensemble) counted it. Gives the
    last reading after `timeout_s` if they never agree (a request that failed in one model)."""
    deadline = time.monotonic() + timeout_s
    while not agree(stats := model_stats(url)) and time.monotonic() < deadline:
        time.sleep(SETTLE_POLL_S)
    return stats
