"""Every test file's name is its own: pytest imports the files of tests/ by their base name
(the folders are not packages), so a second file of one name is not collected, and its
tests silently do not run (tests/unit/test_bench_live.py was, beside a served file of
the same name, until the fresh-clone run reported the collection error)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def clashing_names(folder: Path) -> dict[str, list[str]]:
    """Base names that more than one test file under `folder` has, with their paths."""
    paths = defaultdict(list)
    for path in sorted(folder.rglob("test_*.py")):
        paths[path.name].append(str(path.relative_to(folder)))
    return {name: found for name, found in paths.items() if len(found) > 1}


def test_no_two_test_files_share_a_name():
    assert clashing_names(TESTS) == {}


def test_a_shared_name_is_found(tmp_path):
    for folder in ("unit", "served"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test_same.py").write_text("")
    assert clashing_names(tmp_path) == {"test_same.py": ["served/test_same.py", "unit/test_same.py"]}
