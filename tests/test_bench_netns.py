"""bench/netns.py: two namespaces, a rate-limited veth pair, and a teardown that always runs."""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from netns import measure_throughput, netns_available, netns_link  # noqa: E402

pytestmark = pytest.mark.procs

OK, WHY = netns_available()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
def test_link_is_rate_limited_and_torn_down():
    with netns_link(rate="20mbit") as link:
        assert all(ns in _namespaces() for ns in link.namespaces)
        bps = measure_throughput(link, nbytes=1_000_000) * 8
        assert 2e6 < bps < 22e6, bps  # tbf at 20 Mbit/s (and the transfer really crossed)
    assert not any(ns in _namespaces() for ns in link.namespaces)


@pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
def test_teardown_runs_when_the_body_fails():
    with pytest.raises(RuntimeError, match="boom"):
        with netns_link() as link:
            raise RuntimeError("boom")
    assert not any(ns in _namespaces() for ns in link.namespaces)
