"""How `.ci/run`'s two xdist workers share the suite (`-n 2 --dist loadgroup`).

Each worker is a pytest session of its own, so a session fixture (a shared server)
starts once per worker that runs one of its tests. The groups keep every test of a
shared server on one worker, so that each server starts once, and every other file on
one worker, so that its module-scoped servers and models load once.

xdist hands a worker a new group when it has two tests or fewer left, taking the groups
in the order of their test counts. Files of one or two long tests (a server of their
own, faster-whisper beside the engine) came last, and one worker ran them alone for
most of a minute while the other had finished. `LongestGroupFirst` hands out the group
expected to take longest instead, so that the short ones fill the end.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from xdist.scheduler import LoadGroupScheduling
from xdist.workermanage import WorkerController

SHARED_SERVER_GROUPS = {"server": "session-server", "gateway": "session-server", "base_server": "base-server"}
# A file with tests of the base server keeps its other tests in that group too, so that
# the module fixtures they share (test_languages.py's models) load on one worker only.
# Not so for the session server: its tests are many already.
WHOLE_FILE_GROUPS = ("base-server",)
# The session server's tests are two groups, by file: each worker starts a session
# server of its own (a session fixture is one per worker) for the half it gets. As
# one group (1,399 s of 3,200 at fe226e1) it was the longest path of the run on two
# workers. The halves are balanced by these files' seconds in that group (setup, call
# and teardown summed, `--durations=0`, at 697ef47); a file not named counts
# SESSION_FILE_DEFAULT_S.
SESSION_SERVER_HALVES = ("session-server-1", "session-server-2")
SESSION_FILE_SECONDS = {
    "test_server.py": 172, "test_transcribe_command.py": 160, "test_soak.py": 129,
    "test_streaming.py": 99, "test_loadtest.py": 77, "test_long_audio.py": 74, "test_gateway.py": 74,
    "test_bad_input.py": 62, "test_realtime.py": 59, "test_faults.py": 46, "test_media_served.py": 34,
    "test_quantization.py": 32, "test_transcribe_cancel.py": 31, "test_page.py": 19, "test_bench_streamed_file.py": 19,
    "test_vad_served.py": 15, "test_bench_live_served.py": 40,
}  # fmt: skip
SESSION_FILE_DEFAULT_S = 10

# Each group's seconds on one worker (its tests' setup, call and teardown), the mean of
# two whole runs at fb5a315 on the 2-core development machine (`-p bench.suite_clock`);
# groups of under 5 s are left out. Only their order matters: a group not named counts
# GROUP_TEST_DEFAULT_S a test, and a table gone stale costs balance, never a test.
GROUP_SECONDS = {
    "session-server-1": 504, "session-server-2": 500, "base-server": 273,
    "tests/served/test_faults.py": 189, "tests/unit/test_transcribe.py": 95,
    "tests/served/test_bench_served.py": 88, "tests/unit/test_overlap.py": 87, "tests/unit/test_engine.py": 79,
    "tests/unit/test_longform.py": 72, "tests/unit/test_alignment.py": 71, "tests/served/test_overload.py": 58,
    "tests/served/test_random_models.py": 54, "tests/unit/test_step_kernels.py": 54,
    "tests/served/test_transcribe_cancel.py": 51, "tests/unit/test_beam_search.py": 49,
    "tests/served/test_launcher.py": 48, "tests/served/test_bench_latency.py": 35,
    "tests/unit/test_beam_accuracy.py": 34, "tests/served/test_server.py": 31, "tests/unit/test_translation.py": 27,
    "tests/unit/test_hypothesis_window.py": 26, "tests/unit/test_host_memory.py": 19,
    "tests/unit/test_decoded_tensors.py": 14, "tests/unit/test_bench_alignment_cost.py": 13,
    "tests/unit/test_fuzz_audio.py": 13, "tests/unit/test_turn_order.py": 9, "tests/unit/test_rule_table.py": 8,
    "tests/unit/test_media.py": 7, "tests/unit/test_weights.py": 7, "tests/unit/test_live_overload.py": 6,
}  # fmt: skip
GROUP_TEST_DEFAULT_S = 0.1


def session_server_halves(files: Iterable[str]) -> dict[str, str]:
    """Each file of session-server tests -> its half: the longest first, each to the half with less so far."""
    totals = dict.fromkeys(SESSION_SERVER_HALVES, 0)
    halves = {}
    for file in sorted(set(files), key=lambda f: (-SESSION_FILE_SECONDS.get(Path(f).name, SESSION_FILE_DEFAULT_S), f)):
        half = min(SESSION_SERVER_HALVES, key=lambda h: totals[h])
        halves[file] = half
        totals[half] += SESSION_FILE_SECONDS.get(Path(file).name, SESSION_FILE_DEFAULT_S)
    return halves


def worker_groups(tests: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """Each test (node id -> the fixtures it uses) -> its xdist group: its shared server's
    (a session server's half by its file), else its file's, whole for WHOLE_FILE_GROUPS."""
    groups = {}
    for nodeid, fixtures in tests.items():
        shared = [SHARED_SERVER_GROUPS[name] for name in fixtures if name in SHARED_SERVER_GROUPS]
        groups[nodeid] = shared[0] if shared else file_of(nodeid)
    whole_files = {file_of(nodeid): group for nodeid, group in groups.items() if group in WHOLE_FILE_GROUPS}
    halves = session_server_halves(file_of(nodeid) for nodeid, group in groups.items() if group == "session-server")
    for nodeid, group in groups.items():
        if group == file_of(nodeid):
            groups[nodeid] = whole_files.get(group, group)
        elif group == "session-server":
            groups[nodeid] = halves[file_of(nodeid)]
    return groups


def file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def expected_seconds(group: str, tests: int) -> float:
    return GROUP_SECONDS.get(group, GROUP_TEST_DEFAULT_S * tests)


def longest_group(pending: Mapping[str, int]) -> str:
    """The group (-> its test count) expected to take longest; of equals, the first."""
    return max(pending, key=lambda group: expected_seconds(group, pending[group]))


class LongestGroupFirst(LoadGroupScheduling):
    """xdist's loadgroup scheduling, each free worker given the longest group left."""

    def _assign_work_unit(self, node: WorkerController) -> None:
        longest = longest_group({group: len(tests) for group, tests in self.workqueue.items()})
        self.workqueue.move_to_end(longest, last=False)  # xdist hands out the first
        super()._assign_work_unit(node)
