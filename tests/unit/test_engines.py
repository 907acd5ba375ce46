"""Several whisper engines (and preprocessing instances) on one device: how many `serve`
starts, the repository copy that says so to Triton, and how the engines split the device
between them."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from python_backend_lib.apps import repository
from python_backend_lib.apps.repository import (
    SHIPPED_POSTPROCESSING_GROUP,
    SHIPPED_PREPROCESSING_GROUP,
    SHIPPED_WHISPER_GROUP,
    InstanceGroup,
    engines_to_serve,
    postprocessing_to_serve,
    preprocessing_to_serve,
    read_instance_group,
    repository_with_engines,
    serving_copy,
    with_instance_group,
)
from python_backend_lib.apps.server import packaged_model_repository
from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.engine.faults import FaultPlan
from python_backend_lib.engine.loading import kv_budget
from python_backend_lib.serving.settings import (
    CHECKPOINT_ENV,
    ENGINE_FAULT_PROMPT_ENV,
    FAULT_GPU_ENV,
    FAULT_PROMPT_ENV,
    GpuInstances,
    auto_instances_per_gpu,
    device_label,
    engines_on_device,
    engines_sharing_queue,
)
from python_backend_lib.serving.whisper_pipeline import fault_plan
from whisper_triton.cli import build_parser

GIB = 2**30


def normalized(*groups: dict) -> str:
    """`args["model_config"]` as Triton hands it to `initialize`: KIND_AUTO resolved."""
    return json.dumps({"name": "whisper", "max_batch_size": 64, "instance_group": list(groups)})


def test_the_engines_on_a_device_are_counted_from_tritons_normalized_config():
    two_gpus = normalized({"name": "whisper_0", "kind": "KIND_GPU", "count": 3, "gpus": [0, 1]})
    assert engines_on_device(two_gpus, "cuda:0") == engines_on_device(two_gpus, "cuda:1") == 3  # a count per GPU
    by_hand = normalized({"kind": "KIND_GPU", "count": 1, "gpus": [0]}, {"kind": "KIND_GPU", "count": 2, "gpus": [0, 1]})
    assert (engines_on_device(by_hand, "cuda:0"), engines_on_device(by_hand, "cuda:1")) == (3, 2)
    assert engines_on_device(normalized({"kind": "KIND_CPU", "count": 2}), "cpu") == 2
    assert engines_on_device(normalized({"kind": "KIND_CPU", "count": 2}), "cuda:0") == 1  # itself, at least


def test_every_engine_of_the_model_shares_one_queue():
    two_gpus = normalized({"name": "whisper_0", "kind": "KIND_GPU", "count": 3, "gpus": [0, 1]})
    assert engines_sharing_queue(two_gpus) == 6
    mixed = normalized({"kind": "KIND_GPU", "count": 1, "gpus": [0]}, {"kind": "KIND_CPU", "count": 2})
    assert engines_sharing_queue(mixed) == 3
    assert engines_sharing_queue(normalized({"kind": "KIND_CPU", "count": 1})) == 1


def test_small_checkpoints_get_several_engines_per_gpu_and_large_ones_one():
    sizes = ("tiny", "base", "small", "medium", "large-v3")
    under_mps = [auto_instances_per_gpu(load_config(f"random:{size}").dims, mps=True) for size in sizes]
    alone = [auto_instances_per_gpu(load_config(f"random:{size}").dims, mps=False) for size in sizes]
    # only tiny's host work outruns its GPU (the measurements beside the rule)
    assert under_mps == [GpuInstances(5, 8)] + [GpuInstances(1, 4)] * 4
    assert alone == [GpuInstances(3, 4)] + [GpuInstances(1, 4)] * 4


def test_engines_on_one_gpu_take_equal_kv_shares_however_triton_loads_them():
    total, fraction = 80 * GIB, 0.5
    alone = kv_budget(76 * GIB, total, fraction, engines=1)
    assert alone == 38 * GIB  # one engine: the fraction of what is free, as before
    first = kv_budget(76 * GIB, total, fraction, engines=2)
    second = kv_budget(76 * GIB - first - 4 * GIB, total, fraction, engines=2)  # after the first's KV and weights
    assert first == second == 20 * GIB
    together = 2 * kv_budget(76 * GIB, total, fraction, engines=2)  # loaded at once: each sees all free memory
    assert together == 40 * GIB <= fraction * total


def test_the_instance_group_is_read_and_rewritten_in_place():
    config = (packaged_model_repository() / "whisper" / "config.pbtxt").read_text()
    assert read_instance_group(config) == SHIPPED_WHISPER_GROUP
    rewritten = with_instance_group(config, InstanceGroup(3, "KIND_GPU"))
    assert read_instance_group(rewritten) == InstanceGroup(3, "KIND_GPU")
    changed = [(a.strip(), b.strip()) for a, b in zip(config.splitlines(), rewritten.splitlines()) if a != b]
    assert changed == [("count: 1", "count: 3"), ("kind: KIND_AUTO", "kind: KIND_GPU")]  # nothing else moved
    with pytest.raises(ValueError, match="expected one instance group"):
        read_instance_group(config + "\ninstance_group [ { count: 2\n kind: KIND_CPU } ]\n")


def test_auto_serves_several_engines_only_on_a_gpu_and_only_over_the_shipped_group(tmp_path):
    shipped = (packaged_model_repository() / "whisper" / "config.pbtxt").read_text()
    assert engines_to_serve(shipped, None, gpus=1, checkpoint="random:tiny") == 3
    assert engines_to_serve(shipped, None, gpus=1, checkpoint="random:tiny", mps=True) == 5
    assert engines_to_serve(shipped, None, gpus=1, checkpoint="random:large-v3") is None  # one, as written
    assert engines_to_serve(shipped, None, gpus=0, checkpoint="random:tiny") is None  # the CPU: as written
    assert engines_to_serve(shipped, 2, gpus=0, checkpoint="random:tiny") == 2  # asked for: anywhere
    assert engines_to_serve(shipped, 1, gpus=1, checkpoint="random:tiny") is None
    chosen = repository_with_engines(packaged_model_repository(), 2)  # an owner's own group is served as written
    try:
        assert engines_to_serve((chosen / "whisper" / "config.pbtxt").read_text(), None, gpus=1,
                                checkpoint="random:tiny") is None  # fmt: skip
    finally:
        repository.remove_copy(chosen)


def test_auto_serves_more_preprocessing_only_for_tiny_under_mps_on_a_gpu():
    shipped = (packaged_model_repository() / "preprocessing" / "config.pbtxt").read_text()
    assert read_instance_group(shipped) == SHIPPED_PREPROCESSING_GROUP
    assert preprocessing_to_serve(shipped, gpus=1, checkpoint="random:tiny", mps=True) == 8
    assert preprocessing_to_serve(shipped, gpus=1, checkpoint="random:tiny", mps=False) is None  # four, as written
    assert preprocessing_to_serve(shipped, gpus=1, checkpoint="random:large-v3", mps=True) is None
    assert preprocessing_to_serve(shipped, gpus=0, checkpoint="random:tiny", mps=True) is None  # the CPU
    owned = with_instance_group(shipped, InstanceGroup(2, "KIND_GPU"))
    assert preprocessing_to_serve(owned, gpus=1, checkpoint="random:tiny", mps=True) is None  # an owner's own


def test_postprocessing_runs_one_instance_per_engine_of_the_whole_server():
    """Four postprocessing instances for sixteen engines on four GPUs filled their queue,
    and Triton refused requests the engines had decoded (docs/reliability.md)."""
    shipped = (packaged_model_repository() / "postprocessing" / "config.pbtxt").read_text()
    assert read_instance_group(shipped) == SHIPPED_POSTPROCESSING_GROUP
    assert postprocessing_to_serve(shipped, engines_per_gpu=4, gpus=4) == 16
    assert postprocessing_to_serve(shipped, engines_per_gpu=4, gpus=2) == 8
    assert postprocessing_to_serve(shipped, engines_per_gpu=4, gpus=1) is None  # four, as written
    assert postprocessing_to_serve(shipped, engines_per_gpu=1, gpus=2) is None  # never fewer than written
    assert postprocessing_to_serve(shipped, engines_per_gpu=1, gpus=0) is None  # the CPU
    owned = with_instance_group(shipped, InstanceGroup(2, "KIND_CPU"))
    assert postprocessing_to_serve(owned, engines_per_gpu=4, gpus=4) is None  # an owner's own


@contextlib.contextmanager
def tiny_serving_copy(engines: int | None, gpus: int) -> Iterator[Path]:
    """The copy `serve --gpus` makes for random:tiny under MPS, removed afterwards."""
    copy = serving_copy(packaged_model_repository(), engines, gpus=gpus, environ={CHECKPOINT_ENV: "random:tiny"}, mps=True)
    try:
        yield copy
    finally:
        repository.remove_copy(copy)


def instance_group(copy: Path, model: str) -> InstanceGroup:
    return read_instance_group((copy / model / "config.pbtxt").read_text())


def test_serving_on_four_gpus_runs_postprocessing_for_every_engine():
    with tiny_serving_copy(None, gpus=4) as copy:
        assert instance_group(copy, "whisper") == InstanceGroup(5, "KIND_AUTO")
        assert instance_group(copy, "postprocessing") == InstanceGroup(20, "KIND_CPU")
    with tiny_serving_copy(2, gpus=3) as copy:  # --engines 2
        assert instance_group(copy, "postprocessing") == InstanceGroup(6, "KIND_CPU")


def test_serving_under_mps_rewrites_every_count_for_tiny():
    """Five engines on one GPU: eight preprocessing instances, and one postprocessing
    instance per engine, more than the four written."""
    shipped = packaged_model_repository()
    with tiny_serving_copy(None, gpus=1) as copy:
        assert instance_group(copy, "whisper") == InstanceGroup(5, "KIND_AUTO")
        assert instance_group(copy, "preprocessing") == InstanceGroup(8, "KIND_AUTO")
        assert instance_group(copy, "postprocessing") == InstanceGroup(5, "KIND_CPU")
    with tiny_serving_copy(4, gpus=1) as copy:  # --engines 4: postprocessing as written
        assert (copy / "postprocessing").is_symlink()
        assert (copy / "preprocessing" / "1" / "model.py").resolve() == (shipped / "preprocessing" / "1" / "model.py").resolve()
    assert serving_copy(shipped, None, gpus=0, environ={CHECKPOINT_ENV: "random:tiny"}, mps=False) is None


def test_the_copy_links_every_model_and_rewrites_only_the_whisper_count(tmp_path):
    shipped = packaged_model_repository()
    copy = repository_with_engines(shipped, 3)
    try:
        assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in shipped.iterdir())
        for entry in copy.iterdir():
            if entry.name != "whisper":
                assert entry.is_symlink() and entry.resolve() == (shipped / entry.name).resolve()
        model = copy / "whisper" / "1" / "model.py"
        assert model.resolve() == (shipped / "whisper" / "1" / "model.py").resolve()  # finds the library as before
        config = (copy / "whisper" / "config.pbtxt").read_text()
        assert read_instance_group(config) == InstanceGroup(3, "KIND_AUTO")
    finally:
        repository.remove_copy(copy)
    assert not copy.exists() and (shipped / "whisper" / "1" / "model.py").exists()


def test_a_checkpoint_that_cannot_be_read_leaves_the_repository_as_written(capsys):
    shipped = packaged_model_repository()
    assert serving_copy(shipped, None, gpus=1, environ={CHECKPOINT_ENV: "random:huge"}) is None
    assert re.search(r"serving .* as written: .*huge", capsys.readouterr().err)


@pytest.mark.parametrize(("text", "engines"), [("auto", None), ("1", 1), ("3", 3)])
def test_serve_takes_auto_or_a_number_of_engines(text, engines):
    assert build_parser().parse_args(["serve", "--engines", text]).engines == engines
    assert build_parser().parse_args(["serve"]).engines is None


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_serve_refuses_a_bad_number_of_engines(bad, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--engines", bad])
    assert "expected auto or a number of engines of at least 1" in capsys.readouterr().err


def test_an_engines_gpu_label_is_the_hosts_number_of_its_gpu():
    assert device_label("cpu", {}) == "cpu"
    assert device_label("cuda:1", {}) == "1"
    assert device_label("cuda:0", {"CUDA_VISIBLE_DEVICES": "1"}) == "1"  # serve --gpus 1
    assert device_label("cuda:1", {"CUDA_VISIBLE_DEVICES": "2,3"}) == "3"
    assert device_label("cuda:0", {"CUDA_VISIBLE_DEVICES": "GPU-5e1c"}) == "GPU-5e1c"
    assert device_label("cuda:0", {"CUDA_VISIBLE_DEVICES": ""}) == "0"


def test_the_fault_prompts_arm_only_the_gpu_named():
    prompts = {FAULT_PROMPT_ENV: "step", ENGINE_FAULT_PROMPT_ENV: "loop"}
    assert fault_plan("cuda:0", prompts) == FaultPlan("step", "loop")  # every engine
    assert fault_plan("cpu", prompts) == FaultPlan("step", "loop")
    on_second = {**prompts, FAULT_GPU_ENV: "1"}
    assert fault_plan("cuda:1", on_second) == FaultPlan("step", "loop")
    assert fault_plan("cuda:0", on_second).empty
    assert fault_plan("cuda:0", {**on_second, "CUDA_VISIBLE_DEVICES": "1"}) == FaultPlan("step", "loop")
    assert fault_plan("cuda:0", {}).empty


def test_the_cuda_memory_pool_holds_the_log_mels_only_when_they_travel_on_the_gpu(tmp_path):
    copy = tmp_path / "repository"
    shutil.copytree(packaged_model_repository(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    size = repository.WHISPER_QUEUE * repository.LOG_MEL_BYTES
    pools = (f"--cuda-memory-pool-byte-size=0:{size}", f"--cuda-memory-pool-byte-size=1:{size}")
    # The shipped "auto": GPU memory on one GPU; on several, host memory (the two-GPU stall).
    assert repository.cuda_pool_flags(copy, gpus=1) == pools[:1]
    assert repository.cuda_pool_flags(copy, gpus=2) == ()
    assert repository.cuda_pool_flags(copy, gpus=0) == ()
    config = copy / "preprocessing" / "config.pbtxt"
    auto = r'(key: "log_mel_output"\s*value: \{ string_value: )"auto"'
    shipped = config.read_text()
    config.write_text(re.sub(auto, r'\1"host"', shipped))
    assert repository.cuda_pool_flags(copy, gpus=1) == ()
    config.write_text(re.sub(auto, r'\1"device"', shipped))  # asked for by name: as asked
    assert repository.cuda_pool_flags(copy, gpus=2) == pools


def test_the_launcher_reads_the_stall_bound_the_engines_read(tmp_path):
    """The launcher judges a frozen instance by the same bound as the engines' stall watch."""
    copy = tmp_path / "repository"
    shutil.copytree(packaged_model_repository(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert repository.stall_timeout_s(copy, {}) is None  # shipped: auto
    assert repository.stall_timeout_s(copy, {"WHISPER_TRITON_STALL_TIMEOUT_S": "5"}) == 5.0
    config = copy / "whisper" / "config.pbtxt"
    config.write_text(re.sub(r'(key: "stall_timeout_s"\s*value: \{ string_value: )"auto"', r'\1"90"', config.read_text()))
    assert repository.stall_timeout_s(copy, {}) == 90.0
