"""The offline GPU bundle's pieces that run without a network: ELF reading,
library trimming, pins, and the installer on a small fake bundle.

The real build (downloads from PyPI) is `python scripts/build_gpu_bundle.py`;
docs/gpu-bundle.md says what it produced.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALLER = REPO_ROOT / "scripts" / "install_gpu_bundle.sh"


def load_build_script():
    spec = importlib.util.spec_from_file_location("build_gpu_bundle", REPO_ROOT / "scripts" / "build_gpu_bundle.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bundle = load_build_script()


@pytest.fixture(scope="module")
def pytriton_files() -> tuple[Path, Path]:
    """The installed nvidia-pytriton wheel's server folder and its libraries folder."""
    import pytriton

    server = Path(pytriton.__file__).resolve().parent / "tritonserver"
    return server, server.parent.parent / "nvidia_pytriton.libs"


def test_elf_needed_reads_what_the_server_links(pytriton_files):
    server, _ = pytriton_files
    needed = bundle.elf_needed((server / "bin" / "tritonserver").read_bytes())
    assert any(name.startswith("libtritonserver") for name in needed)
    assert "libc.so.6" in needed


def test_elf_needed_refuses_what_is_not_elf():
    with pytest.raises(ValueError, match="not a 64-bit"):
        bundle.elf_needed(b"#!/bin/sh\necho hi\n")


def test_the_trim_keeps_every_library_but_the_other_pythons(pytriton_files):
    server, libs = pytriton_files
    roots = [
        (server / "bin" / "tritonserver").read_bytes(),
        (server / "backends" / "python" / "libtriton_python.so").read_bytes(),
        (server / "python_backend_stubs" / "3.12" / bundle.STUB_NAME).read_bytes(),
    ]
    libraries = {path.name: path.read_bytes() for path in libs.iterdir()}
    keep, from_host = bundle.needed_closure(roots, libraries)
    dropped = set(libraries) - set(keep)
    assert all(name.startswith("libpython3") for name in dropped), dropped
    assert any(name.startswith("libtritonserver") for name in keep)
    assert "libpython3.12.so.1.0" in from_host and "libc.so.6" in from_host


def test_the_bundle_pins_satisfy_the_project_requirements():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["gpu"]]
    pins = {Requirement(w.requirement).name: Requirement(w.requirement) for w in bundle.WHEELS}
    for requirement in declared:
        if requirement.name in pins:
            (version,) = [spec.version for spec in pins[requirement.name].specifier]
            assert requirement.specifier.contains(version), f"{pins[requirement.name]} breaks {requirement}"
    assert "flashinfer-python" in pins and "numpy" in pins


def test_every_wheel_is_pinned_exactly_and_once():
    names = [Requirement(w.requirement).name for w in bundle.WHEELS]
    assert len(names) == len(set(names))
    for wheel in bundle.WHEELS:
        (spec,) = Requirement(wheel.requirement).specifier
        assert spec.operator == "==", wheel.requirement
        assert wheel.reason


def test_no_http_leaves_out_exactly_the_http_clients_transport():
    from importlib.metadata import requires

    kept = {Requirement(w.requirement).name for w in bundle.selected_wheels(no_http=True)}
    left_out = {Requirement(w.requirement).name for w in bundle.WHEELS} - kept
    assert left_out == {"geventhttpclient", "gevent", "greenlet", "zope.event", "zope.interface", "brotli"}
    assert {"tritonclient", "numpy", "flashinfer-python", "soundfile"} <= kept
    # tritonclient asks for geventhttpclient only with its http (or all) extra: the gRPC client needs none of them
    gevent = [r for r in requires("tritonclient") if r.startswith("geventhttpclient")]
    assert gevent and all(Requirement(r).marker.evaluate({"extra": ""}) is False for r in gevent)
    assert len(bundle.selected_wheels(no_http=False)) == len(bundle.WHEELS)


# --- the installer, on a fake bundle ----------------------------------------------

FAKE_SERVER = "#!/bin/sh\necho 'Usage: tritonserver [options]'\nexit 1\n"


def make_fake_bundle(folder: Path) -> Path:
    """A bundle with the real layout whose server is a shell script."""
    home = folder / "home"
    files = {
        "bin/tritonserver": FAKE_SERVER,
        "backends/python/libtriton_python.so": "",
        "backends/python/triton_python_backend_utils.py": "",
        f"backends/python/{bundle.STUB_NAME}": "#!/bin/sh\n",
        "lib/libtritonserver-0.so": "",
    }
    for name, text in files.items():
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_text(text)
        (home / name).chmod(0o755)
    version = "%d.%d" % sys.version_info[:2]
    archive = f"tritonserver-test-py{version}-x86_64.tar.xz"
    out = folder / "bundle"
    (out / "wheels").mkdir(parents=True)
    (out / "model_repository" / "m" / "1").mkdir(parents=True)
    (out / "model_repository" / "m" / "config.pbtxt").write_text('name: "m"\n')
    with tarfile.open(out / archive, "w:xz") as tar:
        tar.add(home, arcname=bundle.HOME_FOLDER)
    (out / "BUNDLE.json").write_text(f'{{"python_version": "{version}", "triton_archive": "{archive}"}}\n')
    sums = [
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(out)}\n"
        for p in sorted(out.rglob("*"))
        if p.is_file()
    ]
    (out / "SHA256SUMS").write_text("".join(sums))
    return out


def install(bundle_dir: Path, prefix: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHON": sys.executable, "SKIP_WHEELS": "1"}
    return subprocess.run(
        ["bash", str(INSTALLER), str(bundle_dir), str(prefix)], env=environment, capture_output=True, text=True
    )


def test_the_installer_unpacks_the_home_layout_and_writes_env_sh(tmp_path):
    prefix = tmp_path / "prefix"
    completed = install(make_fake_bundle(tmp_path), prefix)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    for name in ("bin/tritonserver", f"backends/python/{bundle.STUB_NAME}", "lib", "model_repository/m/config.pbtxt"):
        assert (prefix / name).exists(), name
    env_sh = (prefix / "env.sh").read_text()
    assert f"export WHISPER_TRITON_HOME={prefix}" in env_sh
    assert f"LD_LIBRARY_PATH={prefix}/lib" in env_sh
    assert f"export PATH={Path(sys.executable).parent}:{prefix}/bin:" in env_sh
    assert f"tritonserver:         {prefix}/bin/tritonserver" in completed.stdout


def test_the_installer_refuses_a_damaged_bundle(tmp_path):
    bundle_dir = make_fake_bundle(tmp_path)
    (bundle_dir / "model_repository" / "m" / "config.pbtxt").write_text("changed in transit\n")
    completed = install(bundle_dir, tmp_path / "prefix")
    assert completed.returncode != 0
    assert "damaged" in completed.stderr
    assert not (tmp_path / "prefix" / "bin").exists()


def test_the_installer_refuses_a_bundle_for_another_python(tmp_path):
    bundle_dir = make_fake_bundle(tmp_path)
    manifest = bundle_dir / "BUNDLE.json"
    manifest.write_text(manifest.read_text().replace('"python_version": "3.', '"python_version": "2.'))
    sums = bundle_dir / "SHA256SUMS"
    lines = [line for line in sums.read_text().splitlines() if not line.endswith("BUNDLE.json")]
    sums.write_text("\n".join([*lines, f"{hashlib.sha256(manifest.read_bytes()).hexdigest()}  BUNDLE.json", ""]))
    environment = {**os.environ, "PYTHON": sys.executable}  # wheels not skipped: the version matters
    completed = subprocess.run(
        ["bash", str(INSTALLER), str(bundle_dir), str(tmp_path / "prefix")],
        env=environment,
        capture_output=True,
        text=True,
    )
    assert completed.returncode != 0
    assert "the bundle is for Python 2." in completed.stderr
