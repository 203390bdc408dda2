"""A real controller and two real node agents, as separate processes, per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.client import RelaunchClient
from service.local_cluster import LocalCluster
from tests.e2e.helpers import running_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("cluster"), ("node-a", "node-b")) as c:
        yield c


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[RelaunchClient]:
    with cluster.client() as c:
        yield c
