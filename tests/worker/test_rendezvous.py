"""torch's dynamic rendezvous kept at a real controller: the backend, the store, and a
whole rendezvous of two launchers' handlers."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
)

from tests.worker.helpers import LiveController, placed
from worker.rendezvous import (
    ControllerBackend,
    ControllerRendezvous,
    ControllerStore,
    handler_for,
    read_token_file,
)


def test_the_backend_writes_with_compare_and_set(live_controller: LiveController) -> None:
    rdzv_id, [token] = placed(live_controller, ["a"], "1")
    backend = ControllerBackend(ControllerRendezvous(live_controller.url, rdzv_id, token))
    assert backend.name == "relaunch"
    assert backend.get_state() is None
    assert backend.set_state(b"\x80first") == (b"\x80first", 1, True)
    assert backend.set_state(b"again") == (b"\x80first", 1, False)  # None: only if none
    assert backend.set_state(b"second", 1) == (b"second", 2, True)
    assert backend.set_state(b"stale", 1) == (b"second", 2, False)
    assert backend.get_state() == (b"second", 2)


def test_the_store_behaves_as_torch_expects(live_controller: LiveController) -> None:
    rdzv_id, [token] = placed(live_controller, ["a"], "1")
    api = ControllerRendezvous(live_controller.url, rdzv_id, token)
    store = ControllerStore(api, timeout=timedelta(seconds=1))
    prefixed = dist.PrefixStore("torch.rendezvous.x.0", store)  # as torch's handler wraps it

    prefixed.set("MASTER_ADDR", "10.0.0.1")
    assert prefixed.get("MASTER_ADDR") == b"10.0.0.1"
    assert prefixed.add("count", 2) == 2 and prefixed.add("count", 3) == 5
    assert prefixed.get("count") == b"5"
    assert prefixed.compare_set("cs", "", "first") == b"first"
    assert prefixed.compare_set("cs", "wrong", "second") == b"first"
    assert prefixed.compare_set("cs", "first", "second") == b"second"
    prefixed.multi_set(["m1", "m2"], ["1", "2"])
    assert prefixed.multi_get(["m1", "m2"]) == [b"1", b"2"]
    assert prefixed.check(["m1", "m2"]) and not prefixed.check(["m1", "nope"])
    prefixed.wait(["m1"], timedelta(seconds=1))
    assert store.num_keys() == 5
    assert store.delete_key("torch.rendezvous.x.0/m1") and not store.check(["m1"])

    with pytest.raises(dist.DistStoreError, match="timeout"):
        prefixed.get("never")

    # A read waits for a key another node writes later.
    later = threading.Timer(1.5, lambda: prefixed.set("late", b"here"))
    later.start()
    store.set_timeout(timedelta(seconds=30))
    assert prefixed.get("late") == b"here"
    later.join()


def test_a_node_of_another_job_is_refused(live_controller: LiveController) -> None:
    rdzv_id, _ = placed(live_controller, ["a"], "1")
    _, [other] = placed(live_controller, ["b"], "1")
    api = ControllerRendezvous(live_controller.url, rdzv_id, other, retry_s=0)
    with pytest.raises(RendezvousConnectionError, match="403"):
        ControllerBackend(api).get_state()
    with pytest.raises(dist.DistStoreError, match="403"):
        ControllerStore(api).set("k", b"v")


def _rendezvous_of(
    live_controller: LiveController, tokens: list[str], rdzv_id: str, **limits: int
) -> dict[int, tuple[int, int, str]]:
    """Each node's (rank, world size, master address) after one rendezvous of all of them,
    each launcher calling with its own node's token."""
    results: dict[int, tuple[int, int, str]] = {}
    errors: list[BaseException] = []
    handlers = []
    for token in tokens:
        params = RendezvousParameters(
            backend="relaunch",
            endpoint=live_controller.url,
            run_id=rdzv_id,
            local_addr="127.0.0.1",
            join_timeout=60,
            **limits,
        )
        handlers.append(handler_for(params, token))

    def join(index: int) -> None:
        try:
            info = handlers[index].next_rendezvous()
            master = info.bootstrap_store_info.master_addr
            results[index] = (info.rank, info.world_size, master)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(tokens))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    for handler in handlers:  # only now: a shutdown closes the rendezvous for every node
        handler.shutdown()
    assert errors == []
    return results


def test_two_launchers_rendezvous_through_the_controller(
    live_controller: LiveController, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    rdzv_id, tokens = placed(live_controller, ["a", "b"], "2")
    results = _rendezvous_of(
        live_controller, tokens, rdzv_id, min_nodes=2, max_nodes=2, last_call_timeout=1
    )
    assert sorted(r[0] for r in results.values()) == [0, 1]
    assert {r[1] for r in results.values()} == {2}
    assert {r[2] for r in results.values()} == {"127.0.0.1"}


def test_a_round_that_every_member_joined_does_not_wait_for_the_last_call(
    live_controller: LiveController, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two members of a job that may grow to three: torch alone would wait the whole last
    # call (an hour here) for a third node; the controller says there are two.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    rdzv_id, tokens = placed(live_controller, ["a", "b"], "1:3")
    api = ControllerRendezvous(live_controller.url, rdzv_id, tokens[0])
    backend = ControllerBackend(api)
    backend.get_state()
    assert backend.members == 2
    results = _rendezvous_of(
        live_controller, tokens, rdzv_id, min_nodes=1, max_nodes=3, last_call_timeout=3600
    )
    assert sorted(r[0] for r in results.values()) == [0, 1]
    assert {r[1] for r in results.values()} == {2}


def test_the_launcher_removes_the_token_file_once_read(tmp_path: Path) -> None:
    path = tmp_path / "node-token"
    path.write_text("rln_secret\n")
    assert read_token_file(path) == "rln_secret"
    assert not path.exists()
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(ValueError, match="no token"):
        read_token_file(empty)
