"""The module-scoped `cluster` fixture most integration modules share: one real Trainyard
(tests/integration/cluster.py) per module. A module that needs other settings (environment,
slots) defines its own `cluster`, which overrides this one."""
from __future__ import annotations

import pytest

from .cluster import Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start()
        yield c
    finally:
        c.stop()
