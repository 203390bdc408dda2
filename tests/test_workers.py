"""How ``make test`` shares the tests among pytest's workers (``work_unit``)."""

from __future__ import annotations

from tests.helpers import CLUSTER_DIRS, REPO_ROOT, work_unit


def test_every_test_that_starts_a_cluster_is_in_one_unit() -> None:
    modules = [p for d in CLUSTER_DIRS for p in (REPO_ROOT / d).rglob("test_*.py")]
    assert len(modules) > 10  # the directories are where the tests are
    units = {work_unit(f"{p.relative_to(REPO_ROOT)}::test_x[a-b]") for p in modules}
    assert units == {"clusters"}


def test_other_tests_go_a_file_at_a_time() -> None:
    nodeid = "tests/service/test_auth.py::test_tokens_are_stored_only_as_hashes[sqlite]"
    assert work_unit(nodeid) == "tests/service/test_auth.py"
    assert work_unit("tests/test_workers.py::test_x") == "tests/test_workers.py"
    # a directory that merely starts like one of them is not one of them
    assert work_unit("tests/e2e_notes/test_x.py::test_y") == "tests/e2e_notes/test_x.py"
