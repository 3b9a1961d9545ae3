"""Start every rank of a plan as local processes (tests, bench, ``make demo``)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from hettrain.api import constants as C
from hettrain.planning.plan import Plan

SOURCE_ROOT = str(Path(__file__).resolve().parents[2])


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(count: int, low: int = 20000, high: int = 32000) -> int:
    """The first of ``count`` consecutive unused TCP ports on 127.0.0.1 (a metrics base for
    :func:`launch_local`: rank ``r`` serves on ``base + r``).

    Drawn below Linux's ephemeral range (32768+), where gloo's own connections and other
    tests' ``free_port()`` picks land, so the block stays free while the ranks start.
    """
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high - count)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports in [{low}, {high})")


def launch_local(plan: Plan, workdir: Path,
                 env_extra: Mapping[str, str] | None = None,
                 rank_env: Callable[[int], Mapping[str, str]] | None = None
                 ) -> list[subprocess.Popen]:
    """One process per rank; ``workdir/plan.json`` is the plan, ``workdir/rank-R.log`` logs.

    A non-zero ``HETTRAIN_METRICS_PORT`` in ``env_extra`` is a base: rank ``r`` serves on
    ``base + r``. ``rank_env(r)``, applied last, sets one rank's own variables (e.g. the
    metrics address and port of the pod it stands for).
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    plan_path = workdir / "plan.json"
    plan_path.write_text(plan.to_json())
    port = free_port()
    procs = []
    for r in range(plan.world_size):
        env = dict(os.environ)
        env["PYTHONPATH"] = SOURCE_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env.update({C.ENV_PLAN_PATH: str(plan_path), C.ENV_MASTER_ADDR: "127.0.0.1",
                    C.ENV_MASTER_PORT: str(port), C.ENV_WORLD_SIZE: str(plan.world_size),
                    C.ENV_NODE_RANK_START: str(r), C.ENV_LOCAL_WORLD_SIZE: "1",
                    C.ENV_RANK: str(r), "OMP_NUM_THREADS": "1"})
        env.update(env_extra or {})
        base = int(env.get("HETTRAIN_METRICS_PORT", "0") or 0)
        if base:  # one port per rank: the pod-local offset would be 0 for every process here
            env["HETTRAIN_METRICS_PORT"] = str(base + r)
        if rank_env is not None:
            env.update(rank_env(r))
        log = open(workdir / f"rank-{r}.log", "w")  # noqa: SIM115 - owned by the child
        procs.append(subprocess.Popen([sys.executable, "-m", "hettrain.runtime"], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float = 300) -> list[int]:
    """Exit codes; on timeout the survivors are killed (code -9)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]


def kill_rank(procs: list[subprocess.Popen], rank: int) -> None:
    """SIGKILL one rank (fault injection)."""
    procs[rank].send_signal(signal.SIGKILL)
