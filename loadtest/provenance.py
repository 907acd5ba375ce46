"""Where a figure comes from: the commit (and whether the tree differed from it), the machine, the date, the command.

A GPU machine gets a copy of the working tree without git, so the commit is
stamped here first:

    python -m loadtest.provenance stamp            # writes .bench/stamp.json (carried with the call)

The stamp holds HEAD and the git blob id of every file HEAD tracks. Where git
is missing, `commit_info` hashes the files on disk the way git does and
compares: any file changed or missing makes the tree dirty, and is named.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
STAMP_PATH = REPO_ROOT / ".bench" / "stamp.json"
MAX_NAMED_CHANGES = 20
# scripts/gpu_run.sh sets this to its own command line, so a run records the device call too.
CALL_ENV = "BENCH_CALL"
# Versions worth recording beside torch and Python.
PACKAGES = ("transformers", "tritonclient", "flashinfer-python", "numpy", "grpcio")


@dataclass(frozen=True)
class CommitInfo:
    commit: str | None
    dirty: bool | None  # None: unknown
    checked_by: str  # "git", "stamp" (files hashed against .bench/stamp.json) or "nothing"
    changed: tuple[str, ...] = ()  # files that differ from the commit (the first MAX_NAMED_CHANGES)


def blob_id(data: bytes) -> str:
    """The id git gives a file's content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _git(*args: str, root: Path) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def git_commit_info(root: Path = REPO_ROOT) -> CommitInfo | None:
    """HEAD and the tracked files that differ from it, by git; None without git or a repository."""
    try:
        commit = _git("rev-parse", "HEAD", root=root).strip()
        status = _git("status", "--porcelain", "--untracked-files=no", root=root)
    except (OSError, subprocess.CalledProcessError):
        return None
    changed = tuple(line[3:] for line in status.splitlines() if line.strip())
    return CommitInfo(commit, bool(changed), "git", changed[:MAX_NAMED_CHANGES])


def write_stamp(root: Path = REPO_ROOT, path: Path = STAMP_PATH) -> dict:
    """HEAD and the blob id of every regular file it tracks."""
    listing = _git("ls-tree", "-r", "-z", "HEAD", root=root)
    blobs = {}
    for entry in filter(None, listing.split("\0")):
        info, name = entry.split("\t", 1)
        mode, kind, blob = info.split()
        if kind == "blob" and mode in ("100644", "100755"):
            blobs[name] = blob
    stamp = {"commit": _git("rev-parse", "HEAD", root=root).strip(), "blobs": blobs}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamp, indent=0, sort_keys=True))
    return stamp


def stamped_commit_info(stamp: dict, root: Path = REPO_ROOT) -> CommitInfo:
    """The stamp's commit; dirty when a file on disk differs from (or lacks) its stamped content."""
    changed = []
    for name, blob in sorted(stamp["blobs"].items()):
        path = root / name
        if not path.is_file() or blob_id(path.read_bytes()) != blob:
            changed.append(name)
    return CommitInfo(stamp["commit"], bool(changed), "stamp", tuple(changed[:MAX_NAMED_CHANGES]))


def commit_info(root: Path = REPO_ROOT, stamp_path: Path = STAMP_PATH) -> CommitInfo:
    """Whichever of the stamp and git finds the tree clean, the stamp first: it was
    written for the copy carried, and a GPU machine's copy may hold a repository whose
    HEAD is not the commit carried (seen: the HEAD of an earlier session's copy). A
    stamp left from an earlier commit finds the tree changed where git, at the new
    commit, finds it clean: git's answer then. When neither is clean, the stamp's, which
    names the files changed since the commit it was written for."""
    stamped = stamped_commit_info(json.loads(stamp_path.read_text()), root) if stamp_path.is_file() else None
    if stamped is not None and not stamped.dirty:
        return stamped
    found = git_commit_info(root)
    if found is not None and (stamped is None or not found.dirty):
        return found
    return stamped or CommitInfo(None, None, "nothing")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _nvidia_smi() -> dict:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
        name, memory_mib, driver = (v.strip() for v in out.split(","))
        return {"gpu": name, "gpu_memory_gib": round(float(memory_mib) / 1024, 1), "driver": driver}
    except (OSError, subprocess.SubprocessError, ValueError):
        return {"gpu": None, "gpu_memory_gib": None, "driver": None}


def machine_info() -> dict:
    import torch

    return {
        **_nvidia_smi(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{package: _version(package) for package in PACKAGES},
    }


def provenance(command: str | None = None) -> dict:
    """The record every benchmark run stores beside its figures."""
    return {
        **asdict(commit_info()),
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": command if command is not None else invocation(),
        "call": os.environ.get(CALL_ENV),  # the script that ran the command, when one did
    }


def invocation() -> str:
    """This process's command line as it was typed: `python -m module args` for a module."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    program = ["-m", spec.name] if spec is not None else [sys.argv[0]]
    return " ".join(["python", *program, *sys.argv[1:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.provenance", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["stamp", "show"])
    args = parser.parse_args(argv)
    if args.action == "stamp":
        stamp = write_stamp()
        print(f"{STAMP_PATH}: {stamp['commit']}, {len(stamp['blobs'])} files")
    else:
        print(json.dumps(provenance(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
