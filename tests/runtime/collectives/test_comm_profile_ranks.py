"""``runtime/comm_profile.py``'s rank handling with real processes: one failing rank ends the
measurement at once (its peer, which would wait on it forever, is killed) and names the rank;
two healthy gloo ranks return the medians of every size."""

from __future__ import annotations

import subprocess
import sys
import time

from hettrain.runtime.comm_profile import _wait_all, measure_comm


def _proc(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_failing_rank_ends_the_wait_and_its_peer() -> None:
    t0 = time.monotonic()
    procs = [_proc("import time; time.sleep(60)"), _proc("raise SystemExit(3)")]
    assert _wait_all(procs, 30) == (1, "exited with code 3")
    assert time.monotonic() - t0 < 20
    assert procs[0].returncode is not None and procs[0].returncode != 0  # killed


def test_the_deadline_kills_every_rank() -> None:
    procs = [_proc("import time; time.sleep(60)") for _ in range(2)]
    assert _wait_all(procs, 0.5) == (0, "took over 0 s")
    assert all(p.returncode is not None for p in procs)


def test_healthy_ranks_report_every_size() -> None:
    procs = [_proc("pass"), _proc("pass")]
    assert _wait_all(procs, 30) is None
    doc = measure_comm([4096, 65536, 1 << 20], 3)
    assert doc is not None and doc["ranks"] == 2 and doc["backend"] == "gloo"
    for kind in ("p2p", "allReduce", "allGather"):  # allGather: the gathered output's bytes
        assert [r["bytes"] for r in doc[kind]] == [4096, 65536, 1 << 20]
        assert all(r["seconds"] > 0 for r in doc[kind])
