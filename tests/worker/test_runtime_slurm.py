"""srun's variables read into a task's place: node lists, tasks per node, the port."""

from __future__ import annotations

import pytest

from worker.runtime.slurm import (
    SlurmTask,
    expand_nodelist,
    first_host,
    is_srun_task,
    port_for_job,
    slurm_task,
    tasks_on_node,
)

# What srun sets for task 3 of 4, two per node on gpu[07-08].
SRUN_ENV = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("localhost", ["localhost"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("a[1-2],b[3],c", ["a1", "a2", "b3", "c"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("rack1-node[2-3].cluster", ["rack1-node2.cluster", "rack1-node3.cluster"]),
        (" x[5] ", ["x5"]),
    ],
)
def test_node_lists_expand_in_order_with_their_padding(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize(
    "nodelist", ["", "a[1-2", "a]1[", "a[2-1]", "a[x]", "a[1-]", "a,,b", "a[1,,2]"]
)
def test_malformed_node_lists_are_refused(nodelist: str) -> None:
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(nodelist)


@pytest.mark.parametrize(
    "value,node,count",
    [("2", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("4,1(x2)", 0, 4), ("4,1(x2)", 2, 1)],
)
def test_tasks_on_a_node(value: str, node: int, count: int) -> None:
    assert tasks_on_node(value, node) == count


@pytest.mark.parametrize("value,node", [("2(x3),1", 4), ("2(x)", 0), ("two", 0), ("2", -1)])
def test_bad_tasks_per_node_are_refused(value: str, node: int) -> None:
    with pytest.raises(ValueError, match="tasks per node"):
        tasks_on_node(value, node)


def test_the_port_is_derived_from_the_job_id_alike_everywhere() -> None:
    assert port_for_job(123456) == 10000 + 123456 % 20000 == 13456
    assert (
        port_for_job(0) == 10000 and port_for_job(19999) == 29999 and port_for_job(20000) == 10000
    )


def test_a_task_reads_its_place_and_the_first_node_as_master() -> None:
    assert is_srun_task(SRUN_ENV)
    assert slurm_task(SRUN_ENV, resolve_host=first_host) == SlurmTask(
        rank=3,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        node_rank=1,
        master_addr="gpu07",
        master_port=13456,
    )


def test_the_step_layout_wins_over_the_job_layout() -> None:
    env = {
        **SRUN_ENV,
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NODEID": "0",
        "SLURM_STEP_NODELIST": "gpu08",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_NTASKS_PER_NODE": "4",
    }
    task = slurm_task(env, resolve_host=first_host)
    assert (task.local_world_size, task.master_addr) == (2, "gpu08")


def test_the_job_values_serve_when_the_step_has_none() -> None:
    env = {
        k: v
        for k, v in SRUN_ENV.items()
        if k not in {"SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}
    }
    assert slurm_task({**env, "SLURM_NTASKS_PER_NODE": "2"}, first_host).local_world_size == 2
    # nothing says how many per node: all of them on this one
    assert slurm_task({**env, "SLURM_LOCALID": "3"}, first_host).local_world_size == 4


def test_master_addr_and_port_from_the_environment_win() -> None:
    def no_lookup(nodelist: str) -> str:
        raise AssertionError(f"looked up {nodelist}")

    task = slurm_task({**SRUN_ENV, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}, no_lookup)
    assert (task.master_addr, task.master_port) == ("10.1.2.3", 29500)


def test_scontrols_answer_is_used_when_there_is_one() -> None:
    task = slurm_task(SRUN_ENV, resolve_host=lambda nodelist: f"first-of-{nodelist}")
    assert task.master_addr == "first-of-gpu[07-08]"


@pytest.mark.parametrize(
    "override,match",
    [
        ({"SLURM_PROCID": "4"}, "SLURM_PROCID"),
        ({"SLURM_NTASKS": "four"}, "SLURM_NTASKS"),
        ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID"),
        ({"SLURM_NODEID": "2"}, "tasks per node"),
        ({"SLURM_JOB_ID": ""}, "MASTER_PORT or SLURM_JOB_ID"),
        ({"SLURM_JOB_NODELIST": "", "SLURM_STEP_NODELIST": ""}, "MASTER_ADDR or one of"),
    ],
)
def test_bad_or_missing_variables_are_named(override: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        slurm_task({**SRUN_ENV, **override}, resolve_host=first_host)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2"},
        {"SLURM_PROCID": "0", "SLURM_NTASKS": " "},
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "5"},  # srun -n1: alone
    ],
)
def test_without_srun_task_variables_it_is_no_srun_task(env: dict[str, str]) -> None:
    assert not is_srun_task(env)
