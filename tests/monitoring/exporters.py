"""Metric exporters for the Prometheus e2e test, using the real hettrain metric modules.

``python exporters.py operator PORT`` serves ``hettrain.metrics`` (the operator's);
``python exporters.py runtime PORT RANK`` serves ``hettrain.runtime.metrics`` for one rank.
Both keep updating values so rates and histograms have data, and print ``ready``.
"""

from __future__ import annotations

import math
import sys
import time


def run_operator(port: int) -> None:
    """A job running with a 2-rank plan, one repair and one failed plan so far."""
    from hettrain import metrics as m

    m.serve(port)
    m.set_phase("ml", "llama", "Running")
    m.set_phase("ml", "broken", "Failed")
    print("ready", flush=True)
    i = 0
    while True:
        m.set_plan("ml", "llama", world=2, tokens=12000.0, mfu=0.42, seconds=0.01 + 0.001 * i)
        m.REPAIRS.labels("ml", "llama", "node_lost").inc(0.1)
        m.PLAN_FAILURES.labels("ml", "broken", "no_fit").inc(0.1)
        m.RECONCILE_ERRORS.labels("daemon").inc(0.01)
        i += 1
        time.sleep(0.2)


def run_runtime(port: int, rank: int) -> None:
    """One rank of a 2-stage job (rank r is stage r on pool POOLS[r]), stepping every 0.2s."""
    from hettrain.runtime.collectives.stats import CommStats, Tier
    from hettrain.runtime.metrics import RuntimeMetrics

    rm = RuntimeMetrics("llama", rank, rank, POOLS[rank], port)
    stats = CommStats()
    print("ready", flush=True)
    step = 0
    while True:
        step += 1
        secs = 0.05 + 0.01 * rank + 0.005 * math.sin(step)
        rm.observe_step(step, loss=5.0 / math.sqrt(step), seconds=secs, tokens=4096,
                        flops=4e13 * secs * (0.35 + 0.02 * math.sin(step)), peak_flops=1e14)
        for k, (tier, nbytes) in enumerate(((Tier.INTRA_POOL, 1 << 24),
                                            (Tier.INTER_POOL, 1 << 20), (Tier.CROSS_DC, 1 << 16))):
            stats.add(tier, nbytes, 0.001 * (1 + k))
        rm.observe_comm(stats)
        if step % 10 == 0:
            rm.last_ckpt.set(step)
        time.sleep(0.2)


POOLS = ("h100", "mi300x")


if __name__ == "__main__":
    if sys.argv[1] == "operator":
        run_operator(int(sys.argv[2]))
    else:
        run_runtime(int(sys.argv[2]), int(sys.argv[3]))
