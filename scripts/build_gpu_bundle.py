#!/usr/bin/env python3
"""Build the offline bundle for an air-gapped GPU host.

Run this on a machine that reaches PyPI. It writes one folder (default
`.bundle/`) holding what a host with only a stock PyTorch image (Python 3.12,
torch, transformers) lacks and cannot download:

  tritonserver-<triton>-py<X.Y>-x86_64.tar.xz
      Triton Inference Server taken from the nvidia-pytriton wheel, trimmed to
      the server, the Python backend with the one stub for Python X.Y, and the
      shared libraries those need. It unpacks into WHISPER_TRITON_HOME:
      bin/tritonserver, backends/python/, caches/local/, lib/.
  wheels/*.whl
      Pinned wheels missing from the image, and this project's own wheel.
  model_repository/
      The Triton model repository, which the wheel does not hold.
  install_gpu_bundle.sh, BUNDLE.json, SHA256SUMS

The whole folder must stay under --limit-mib (64 MiB by default): the build
prints every size and fails when the total is over. Only the standard library
and pip are needed; `docs/gpu-bundle.md` explains the result.

    python scripts/build_gpu_bundle.py [--out .bundle] [--python-version 3.12]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
INSTALL_SCRIPT = REPO_ROOT / "scripts" / "install_gpu_bundle.sh"
MODEL_REPOSITORY = "model_repository"

MIB = 1024 * 1024
DEFAULT_LIMIT_MIB = 64
DEFAULT_PYTHON_VERSION = "3.12"

# The server comes out of this wheel; 0.7.0 ships Triton 2.51.0, the release of
# the nvcr.io/nvidia/tritonserver:24.10 image.
PYTRITON_REQUIREMENT = "nvidia-pytriton==0.7.0"
TRITON_VERSION = "2.51.0"
# The only platform tag nvidia-pytriton 0.7.0 is published for.
PYTRITON_PLATFORM = "manylinux_2_35_x86_64"
# Tags accepted for the other wheels, newest glibc first. pip matches each tag
# exactly, so name every one a wanted wheel may carry (the host image is at
# least glibc 2.35, the floor nvidia-pytriton itself sets).
WHEEL_PLATFORMS = (
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)

# Inside the tarball everything sits under one folder, so that unpacking it by
# hand makes no mess; the install script strips it.
HOME_FOLDER = "whisper-triton-home"
# Paths inside the nvidia-pytriton wheel.
WHEEL_SERVER = "pytriton/tritonserver/"
WHEEL_LIBS = "nvidia_pytriton.libs/"
WHEEL_LICENSE = "nvidia_pytriton-0.7.0.dist-info/licenses/LICENSE"
STUB_NAME = "triton_python_backend_stub"
# wheel path -> path under WHISPER_TRITON_HOME. The stub for the chosen Python
# goes beside the backend, where Triton's Python backend looks for it.
SERVER_FILES = {
    WHEEL_SERVER + "bin/tritonserver": "bin/tritonserver",
    WHEEL_SERVER + "backends/python/libtriton_python.so": "backends/python/libtriton_python.so",
    WHEEL_SERVER + "backends/python/triton_python_backend_utils.py": "backends/python/triton_python_backend_utils.py",
    WHEEL_SERVER + "caches/local/libtritoncache_local.so": "caches/local/libtritoncache_local.so",
    WHEEL_LICENSE: "LICENSE.nvidia-pytriton",
}


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel of the bundle and the reason it is there.

    http: only `tritonclient.http` needs it (its transport); `--no-http` leaves it out.
    """

    requirement: str
    reason: str
    http: bool = False


# What a stock PyTorch image lacks. Already there, and so left out: torch,
# transformers, tokenizers, safetensors, tqdm, grpcio, protobuf, aiohttp,
# urllib3, certifi, ml-dtypes, packaging, einops, ninja, click, requests,
# tabulate, nvidia-ml-py. Left out on purpose: flashinfer's nvidia-cudnn-frontend
# and nvidia-cutlass-dsl (its cuDNN and CuTe-DSL kernels, which the engine does
# not call, and far too big), nvidia-pytriton itself (the tarball replaces it),
# av (PyAV: 34 MiB of FFmpeg libraries, which would take the bundle to about
# 94 MiB; without it the server reads what libsndfile reads, WAV, FLAC, Ogg and
# MP3, and names PyAV when a request sends M4A, MP4, WebM or video), and the
# model checkpoint (carried on its own, see docs/gpu-bundle.md).
WHEELS = (
    Wheel("numpy==1.26.4", "the Triton 2.51 Python-backend stub corrupts inputs under numpy 2, which the image ships"),
    Wheel("flashinfer-python==0.6.4", "the engine's attention kernels (the project's gpu extra)"),
    Wheel("apache-tvm-ffi==0.1.15.post2", "flashinfer 0.6.4 needs apache-tvm-ffi>=0.1.6,<0.2, not 0.1.8 or 0.1.8.post0"),
    Wheel("soundfile==0.14.0", "audio decoding (ships its own libsndfile)"),
    Wheel("cffi==2.1.1", "needed by soundfile"),
    Wheel("pycparser==3.12", "needed by cffi"),
    Wheel("soxr==1.1.0", "resampling to 16 kHz"),
    Wheel("tritonclient==2.73.0", "clients, health checks and load tests, over gRPC and HTTP"),
    Wheel("python-rapidjson==1.25", "needed by tritonclient"),
    Wheel("geventhttpclient==2.6.1", "tritonclient.http's transport", http=True),
    Wheel("gevent==26.9.0", "needed by geventhttpclient", http=True),
    Wheel("greenlet==3.3.2", "needed by gevent; tritonclient[http] wants greenlet<3.4", http=True),
    Wheel("zope.event==6.2", "needed by gevent", http=True),
    Wheel("zope.interface==8.7", "needed by gevent", http=True),
    Wheel("brotli==1.2.1", "needed by geventhttpclient", http=True),
)


def log(message: str) -> None:
    print(message, flush=True)


def mib(n_bytes: int) -> str:
    return f"{n_bytes / MIB:.1f} MiB"


def pip_download(requirement: str, dest: Path, *, python_version: str, platforms: tuple[str, ...]) -> Path:
    """Download one binary wheel for the target Python and platform; return its path.

    Each requirement gets its own folder under `dest`, per Python version, so a
    second build finds the file there and pip does not fetch it again.
    """
    folder = dest / f"py{python_version}" / requirement.replace("==", "-")
    folder.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--python-version", python_version, "--implementation", "cp",
        *(arg for platform in platforms for arg in ("--platform", platform)),
        "--dest", str(folder), requirement,
    ]
    subprocess.run(command, check=True)
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one wheel for {requirement} in {folder}, found {[w.name for w in wheels]}")
    return wheels[0]


# ELF constants for reading DT_NEEDED from a 64-bit little-endian file.
ELF_MAGIC = b"\x7fELF"
ELFCLASS64, ELFDATA2LSB = 2, 1
SHT_DYNAMIC = 6
DT_NULL, DT_NEEDED = 0, 1
SECTION_HEADER = struct.Struct("<IIQQQQIIQQ")  # name type flags addr offset size link info align entsize
DYNAMIC_ENTRY = struct.Struct("<qQ")  # d_tag, d_val


def elf_needed(data: bytes) -> tuple[str, ...]:
    """The shared libraries an ELF file names as DT_NEEDED, in file order."""
    if data[:4] != ELF_MAGIC or data[4] != ELFCLASS64 or data[5] != ELFDATA2LSB:
        raise ValueError("not a 64-bit little-endian ELF file")
    (section_offset,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, n_sections = struct.unpack_from("<HH", data, 0x3A)
    sections = [SECTION_HEADER.unpack_from(data, section_offset + i * entry_size) for i in range(n_sections)]
    needed = []
    for _, kind, _, _, offset, size, link, *_ in sections:
        if kind != SHT_DYNAMIC:
            continue
        strings_offset = sections[link][4]  # the dynamic section links to its string table
        for position in range(offset, offset + size, DYNAMIC_ENTRY.size):
            tag, value = DYNAMIC_ENTRY.unpack_from(data, position)
            if tag == DT_NULL:
                break
            if tag == DT_NEEDED:
                end = data.index(b"\0", strings_offset + value)
                needed.append(data[strings_offset + value : end].decode())
    return tuple(needed)


def needed_closure(roots: list[bytes], libraries: dict[str, bytes]) -> tuple[list[str], list[str]]:
    """Follow DT_NEEDED from `roots` through `libraries` (name -> ELF bytes).

    Returns the library names to keep, and the names found nowhere in
    `libraries`, which the host must provide (libc, libstdc++, libpython...).
    """
    keep: list[str] = []
    from_host: set[str] = set()
    pending = [name for root in roots for name in elf_needed(root)]
    while pending:
        name = pending.pop()
        if name in keep or name in from_host:
            continue
        if name in libraries:
            keep.append(name)
            pending.extend(elf_needed(libraries[name]))
        else:
            from_host.add(name)
    return sorted(keep), sorted(from_host)


@dataclass(frozen=True)
class ServerTree:
    """The trimmed server: relative path -> (bytes, executable?)."""

    files: dict[str, tuple[bytes, bool]]
    host_libraries: list[str]
    dropped: list[str]


def trim_server(pytriton_wheel: Path, python_version: str) -> ServerTree:
    """Pick out of the nvidia-pytriton wheel what the server needs for one Python."""
    stub = f"{WHEEL_SERVER}python_backend_stubs/{python_version}/{STUB_NAME}"
    with zipfile.ZipFile(pytriton_wheel) as wheel:
        names = set(wheel.namelist())
        if stub not in names:
            available = sorted({n.split("/")[3] for n in names if "/python_backend_stubs/" in n and n.count("/") > 3})
            raise SystemExit(f"nvidia-pytriton has no stub for Python {python_version}; it has {available}")

        def read(name: str) -> tuple[bytes, bool]:
            info = wheel.getinfo(name)
            executable = bool((info.external_attr >> 16) & stat.S_IXUSR)
            return wheel.read(name), executable

        files = {target: read(source) for source, target in SERVER_FILES.items()}
        files[f"backends/python/{STUB_NAME}"] = (wheel.read(stub), True)
        libraries = {n[len(WHEEL_LIBS) :]: n for n in names if n.startswith(WHEEL_LIBS) and not n.endswith("/")}
        library_bytes = {name: wheel.read(path) for name, path in libraries.items()}

    elf_roots = [data for path, (data, _) in files.items() if not path.endswith((".py", "LICENSE.nvidia-pytriton"))]
    keep, host = needed_closure(elf_roots, library_bytes)
    for name in keep:
        files[f"lib/{name}"] = (library_bytes[name], False)
    dropped = sorted(set(libraries) - set(keep))
    return ServerTree(files=files, host_libraries=host, dropped=dropped)


def pack_server(tree: ServerTree, archive: Path) -> None:
    """Write the tree as a reproducible .tar.xz (fixed times and owners), with progress."""
    total = sum(len(data) for data, _ in tree.files.values())
    done, next_report = 0, 0.25
    directories = sorted({str(parent) for name in tree.files for parent in Path(name).parents} - {"."})
    with tarfile.open(archive, "w:xz", preset=9) as tar:

        def add(name: str, mode: int, data: bytes | None) -> None:
            info = tarfile.TarInfo(f"{HOME_FOLDER}/{name}" if name else HOME_FOLDER)
            info.mode, info.mtime, info.uname, info.gname = mode, 0, "root", "root"
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

        add("", 0o755, None)
        for directory in directories:
            add(directory, 0o755, None)
        for name in sorted(tree.files):
            data, executable = tree.files[name]
            add(name, 0o755 if executable else 0o644, data)
            done += len(data)
            if done / total >= next_report:
                log(f"      packed {done / total:4.0%} ({mib(done)} of {mib(total)})")
                next_report += 0.25


def checkout_files(under: str = "") -> list[str]:
    """Files of the checkout that git tracks or would track (untracked, not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", under or "."],
        cwd=REPO_ROOT, check=True, capture_output=True, text=True,
    ).stdout.split("\0")
    return sorted(name for name in listed if name and (REPO_ROOT / name).is_file())


def copy_files(names: list[str], dest: Path, strip: str = "") -> None:
    """Copy checkout files (relative paths) under `dest`, less the prefix `strip`."""
    for name in names:
        target = dest / name.removeprefix(strip)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, target)


def build_own_wheel(dest: Path) -> Path:
    """Build this project's wheel from a clean copy of the checkout's files."""
    with tempfile.TemporaryDirectory(prefix="whisper-triton-src-") as source:
        copy_files(checkout_files(), Path(source))
        if not (Path(source) / "README.md").is_file():
            raise SystemExit("README.md is missing: pyproject.toml names it as the long description")
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dest), source],
            check=True,
        )
    wheels = sorted(dest.glob("whisper_triton-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one whisper_triton wheel in {dest}, found {[w.name for w in wheels]}")
    return wheels[0]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".bundle", help="bundle folder (emptied first)")
    parser.add_argument("--python-version", default=DEFAULT_PYTHON_VERSION, help="the GPU host's Python, X.Y")
    parser.add_argument("--cache", type=Path, default=REPO_ROOT / ".cache" / "gpu-bundle", help="downloads kept here")
    parser.add_argument("--limit-mib", type=float, default=DEFAULT_LIMIT_MIB, help="fail when the bundle is larger")
    parser.add_argument(
        "--no-http",
        action="store_true",
        help="leave out the wheels only tritonclient.http needs (gevent and its kin): a gRPC-only host",
    )
    parser.add_argument(
        "--no-project-wheel",
        action="store_true",
        help="leave this project's wheel out (a host that runs from a checkout of it)",
    )
    args = parser.parse_args(argv)
    parts = args.python_version.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        parser.error(f"--python-version must look like 3.12, got {args.python_version!r}")
    return args


def selected_wheels(no_http: bool) -> tuple[Wheel, ...]:
    """The pinned wheels a build packs: all of them, or all but the HTTP client's transport."""
    return tuple(w for w in WHEELS if not (no_http and w.http))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wheels = selected_wheels(args.no_http)
    out: Path = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    (out / "wheels").mkdir(parents=True)
    n_steps = 3 + len(wheels) + 1
    started = time.monotonic()

    def step(number: int, message: str) -> None:
        log(f"[{number:2d}/{n_steps}] {message}")

    step(1, f"download {PYTRITON_REQUIREMENT}")
    pytriton = pip_download(
        PYTRITON_REQUIREMENT, args.cache, python_version=args.python_version, platforms=(PYTRITON_PLATFORM,)
    )
    log(f"      {pytriton.name}: {mib(pytriton.stat().st_size)}")

    step(2, f"trim Triton {TRITON_VERSION} to the Python {args.python_version} backend")
    tree = trim_server(pytriton, args.python_version)
    kept = sum(len(data) for data, _ in tree.files.values())
    log(f"      kept {len(tree.files)} files, {mib(kept)}; dropped {len(tree.dropped)}: {', '.join(tree.dropped)}")
    log(f"      the host must provide: {', '.join(tree.host_libraries)}")

    archive = out / f"tritonserver-{TRITON_VERSION}-py{args.python_version}-x86_64.tar.xz"
    step(3, f"pack {archive.name} (xz -9, about a minute)")
    pack_server(tree, archive)
    log(f"      {archive.name}: {mib(archive.stat().st_size)}")

    for number, wheel in enumerate(wheels, start=4):
        step(number, f"download {wheel.requirement}")
        path = pip_download(
            wheel.requirement, args.cache, python_version=args.python_version, platforms=WHEEL_PLATFORMS
        )
        shutil.copy2(path, out / "wheels" / path.name)
        log(f"      {path.name}: {mib(path.stat().st_size)}")

    if args.no_project_wheel:
        step(n_steps, "copy model_repository/ (--no-project-wheel: no wheel of this project)")
        own_name = None
    else:
        step(n_steps, "build this project's wheel and copy model_repository/")
        own = build_own_wheel(out / "wheels")
        own_name = own.name
        log(f"      {own.name}: {mib(own.stat().st_size)}")
    # The wheel does not hold the model repository; the installer puts this
    # copy into WHISPER_TRITON_HOME/model_repository.
    models = checkout_files(MODEL_REPOSITORY)
    copy_files(models, out / MODEL_REPOSITORY, strip=f"{MODEL_REPOSITORY}/")
    log(f"      {MODEL_REPOSITORY}/: {len(models)} files, {mib(folder_size(out / MODEL_REPOSITORY))}")

    shutil.copy2(INSTALL_SCRIPT, out / INSTALL_SCRIPT.name)
    (out / INSTALL_SCRIPT.name).chmod(0o755)
    manifest = {
        "python_version": args.python_version,
        "triton_version": TRITON_VERSION,
        "triton_archive": archive.name,
        "triton_from": PYTRITON_REQUIREMENT,
        "host_libraries": tree.host_libraries,
        "wheels": {w.requirement: w.reason for w in wheels},
        "http_client": not args.no_http,
        "project_wheel": own_name,
        "model_repository": MODEL_REPOSITORY,
    }
    (out / "BUNDLE.json").write_text(json.dumps(manifest, indent=2) + "\n")
    payload = sorted(p for p in out.rglob("*") if p.is_file())
    (out / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.relative_to(out)}\n" for p in payload))

    log("")
    log(f"bundle {out} ({time.monotonic() - started:.0f} s):")
    for path in sorted(p for p in out.rglob("*") if p.is_file() and MODEL_REPOSITORY not in p.relative_to(out).parts):
        log(f"  {path.stat().st_size / MIB:7.2f} MiB  {path.relative_to(out)}")
    log(f"  {folder_size(out / MODEL_REPOSITORY) / MIB:7.2f} MiB  {MODEL_REPOSITORY}/")
    total = folder_size(out)
    log(f"  {total / MIB:7.2f} MiB  total (limit {args.limit_mib:g} MiB)")
    if total > args.limit_mib * MIB:
        log(f"error: the bundle is {mib(total)}, over the {args.limit_mib:g} MiB limit")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
