"""bench/slowlink.py: the delay line's arithmetic, and a live link between two namespaces."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import slowlink


def test_direction_serialises_at_the_rate_then_adds_the_delay():
    d = slowlink.Direction(rate_bps=8e6, delay_s=0.005, limit=10_000)  # 1 MB/s
    d.push(b"x" * 1000, now=1.0)  # 1 ms on the wire
    d.push(b"y" * 1000, now=1.0)  # queued behind the first: departs at 1.002
    d.push(b"z" * 500, now=1.5)  # idle link again: departs at 1.5005
    times = [t for t, _ in d.queue]
    assert times == pytest.approx([1.006, 1.007, 1.5055])
    assert d.due(1.0065) == [b"x" * 1000]
    assert d.next_due() == pytest.approx(1.007)
    assert d.due(2.0) == [b"y" * 1000, b"z" * 500]
    assert d.next_due() is None


def test_direction_tail_drops_beyond_the_byte_limit():
    d = slowlink.Direction(rate_bps=8e6, delay_s=0.0, limit=3000)  # 3 ms of backlog allowed
    for _ in range(6):
        d.push(b"p" * 1000, now=0.0)
    # backlog before each push: 0, 1, 2, 3 ms (= limit, still taken), then 4 ms: dropped
    assert len(d.queue) == 4 and d.dropped == 2
    unlimited = slowlink.Direction(rate_bps=0, delay_s=0.01, limit=1)
    for _ in range(5):
        unlimited.push(b"q" * 100, now=0.0)
    assert len(unlimited.queue) == 5 and unlimited.due(0.01) == [b"q" * 100] * 5


def _can_build_namespaces() -> bool:
    return (os.geteuid() == 0 and shutil.which("ip") is not None
            and os.path.exists("/dev/net/tun")
            and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0)


@pytest.mark.skipif(not _can_build_namespaces(), reason="needs root, iproute2 and /dev/net/tun")
def test_live_link_has_the_delay_and_never_exceeds_the_rate():
    rate_gbit, delay_ms = 0.2, 20.0
    with slowlink.SlowLink(rate_gbit, delay_ms):
        tx0 = _tx_bytes()
        got = slowlink.probe(pings=10, bulk_mib=8)
        tx1 = _tx_bytes()
    assert not any(Path("/run/netns", ns).exists() for ns in slowlink.NS)  # torn down
    # a TCP round trip crosses the link twice: at least 2 x delay, and not much more
    assert 2 * delay_ms <= got["rtt_ms_min"] <= got["rtt_ms_median"] < 2 * delay_ms + 25
    # payload can never beat the serialisation rate; it does come close on a bulk transfer
    assert 0.2 * rate_gbit < got["throughput_gbit"] <= rate_gbit * 1.01
    assert tx1 - tx0 >= 8 << 20  # every bulk byte crossed the TUN device A -> B


def _tx_bytes() -> int:
    out = subprocess.run(["ip", "netns", "exec", slowlink.NS[0], "cat",
                          f"/sys/class/net/{slowlink.DEV[0]}/statistics/tx_bytes"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)
