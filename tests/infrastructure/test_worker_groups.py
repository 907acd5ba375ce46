"""tests/worker_groups.py: the groups `.ci/run`'s two workers share, and the order xdist
hands them out in (the longest expected first, not the one of most tests)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import worker_groups
from conftest import pytest_xdist_make_scheduler
from worker_groups import GROUP_SECONDS, SESSION_SERVER_HALVES, WHOLE_FILE_GROUPS, LongestGroupFirst, longest_group

REPO = Path(__file__).resolve().parents[2]


def test_every_timed_group_is_a_file_of_the_suite_or_a_shared_servers():
    named = set(SESSION_SERVER_HALVES) | set(WHOLE_FILE_GROUPS)
    assert [group for group in GROUP_SECONDS if group not in named and not (REPO / group).is_file()] == []


def test_the_longest_expected_group_goes_first_not_the_one_of_most_tests():
    pending = {"tests/unit/test_audio.py": 90, "tests/unit/test_beam_accuracy.py": 1, "tests/unit/test_new.py": 40}
    assert longest_group(pending) == "tests/unit/test_beam_accuracy.py"
    # Groups the table does not name are ordered by their test counts, as xdist orders them.
    assert longest_group({"tests/unit/test_a.py": 3, "tests/unit/test_b.py": 30}) == "tests/unit/test_b.py"


class Worker:
    """What xdist's scheduler calls on a worker: the indexes of the tests it is sent."""

    def __init__(self) -> None:
        self.sent: list[list[int]] = []

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent.append(indexes)


def test_xdist_sends_a_free_worker_the_longest_group():
    collection = ["tests/unit/test_audio.py::test_a", "tests/unit/test_audio.py::test_b",
                  "tests/unit/test_beam_accuracy.py::test_c", "tests/unit/test_turn_order.py::test_d"]  # fmt: skip
    scheduler = LongestGroupFirst.__new__(LongestGroupFirst)  # its state as xdist's schedule() leaves it
    worker = Worker()
    scheduler.registered_collections = {worker: collection}
    scheduler.assigned_work = {}
    scheduler.workqueue = OrderedDict(
        (group, {nodeid: False for nodeid in collection if nodeid.startswith(group)})
        for group in ("tests/unit/test_audio.py", "tests/unit/test_turn_order.py", "tests/unit/test_beam_accuracy.py")
    )
    for _ in range(3):
        scheduler._assign_work_unit(worker)
    assert worker.sent == [[2], [3], [0, 1]]  # beam accuracy (34 s), turn order (9 s), then audio


def test_the_hook_schedules_loadgroup_only():
    def config(dist: str):  # what the hook and xdist's scheduler read of pytest's config
        return SimpleNamespace(getvalue={"dist": dist, "tx": ["2*popen"]}.get)

    assert pytest_xdist_make_scheduler(config("load"), log=None) is None
    assert isinstance(pytest_xdist_make_scheduler(config("loadgroup"), log=None), LongestGroupFirst)


def test_a_shared_servers_tests_share_a_group_and_other_files_their_own():
    tests = {
        "tests/served/test_languages.py::test_a": ["base_server"],
        "tests/served/test_languages.py::test_b": ["tmp_path"],  # the base server's file stays whole
        "tests/served/test_server.py::test_c": ["server"],
        "tests/served/test_soak.py::test_d": ["server", "gateway"],
        "tests/unit/test_engine.py::test_e": [],
    }
    groups = worker_groups.worker_groups(tests)
    assert groups["tests/served/test_languages.py::test_a"] == groups["tests/served/test_languages.py::test_b"] == "base-server"
    # The session server's two longest files go to its two halves, one worker each.
    assert {groups["tests/served/test_server.py::test_c"], groups["tests/served/test_soak.py::test_d"]} == set(
        SESSION_SERVER_HALVES
    )
    assert groups["tests/unit/test_engine.py::test_e"] == "tests/unit/test_engine.py"
    assert worker_groups.file_of("tests/unit/test_engine.py::test_e[x]") == "tests/unit/test_engine.py"
