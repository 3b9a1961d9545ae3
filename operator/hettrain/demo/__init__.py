"""``hettrain demo``: the whole system on one machine, in a few minutes.

A local control plane (``e2e/cluster/up``) with a four-vendor / two-datacenter kwok cluster, the
operator as a child process, a local S3 server (moto) whose credentials reach the ranks through
a Secret, the demo job (a small Llama on the shipped corpus) applied and planned, its planned
ranks trained as local CPU processes (gloo) checkpointing to the bucket, a node failure
injected, the repair and the training resumed from the object store on the new layout, and
the operator's and runtime's metrics printed. Ctrl-C at any point stops everything.
"""

from __future__ import annotations

import argparse

from hettrain.argtypes import float_in, int_in
from hettrain.demo.flow import CLUSTER_YAML, JOB_YAML, NAMESPACE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``hettrain demo``."""
    parser.description = (
        "Start a local Kubernetes control plane with fake (kwok) GPU nodes of four vendors in "
        "two datacenters, run the operator, start a local S3 server for the checkpoints (its "
        "credentials in a Secret), apply the demo job (a small Llama on the shipped corpus, "
        "prepared once and cached), show its plan, train the planned ranks as local CPU "
        "processes, fail a node, show the repair and the training resumed from the object "
        "store on the new layout, print the metrics, and tear everything down. Ctrl-C stops "
        "it cleanly.")
    parser.add_argument("--steps", type=int_in(2, 10**6), default=40,
                        help="training steps of the job (default 40)")
    parser.add_argument("--fail-at", type=int_in(1, 10**6), default=None, metavar="STEP",
                        help="fail a node after this many steps (default steps/2 + 2)")
    parser.add_argument("--checkpoint-interval", type=int_in(1, 10**6), default=5, metavar="N",
                        help="checkpoint every N steps (default 5)")
    parser.add_argument("--step-sleep", type=float_in(0, 3600), default=0.0, metavar="S",
                        help="sleep S seconds per training step, to watch it slowly")
    parser.add_argument("--no-train", action="store_true",
                        help="skip the local training (plan, failure and repair only)")
    parser.add_argument("--keep", action="store_true",
                        help="leave the control plane running at the end (prints how to stop "
                             "it)")
    parser.add_argument("--workdir", metavar="DIR",
                        help="logs, pictures, checkpoints, cluster state (default: a new temp "
                             "dir)")
    parser.add_argument("--cluster", default=CLUSTER_YAML, metavar="CLUSTER.yaml",
                        help=f"kwok nodes to create, relative to the repo (default "
                             f"{CLUSTER_YAML})")
    parser.add_argument("--job", default=JOB_YAML, metavar="JOB.yaml",
                        help=f"the job to apply, relative to the repo (default {JOB_YAML})")
    parser.add_argument("--namespace", default=NAMESPACE, help=f"default {NAMESPACE}")
    parser.add_argument("--train-timeout", type=float_in(0, 86400, lo_open=True), default=300.0,
                        metavar="S",
                        help="give up when training makes no progress for S seconds")
    parser.add_argument("--repo", metavar="PATH",
                        help="the hettrain checkout (default: the installed source tree)")


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when training resumed from a checkpoint and the loss fell before and
    after the repair, 130 on Ctrl-C."""
    from hettrain.demo.cluster import DemoError
    from hettrain.demo.flow import run_demo

    if args.steps < 2:
        raise SystemExit("error: --steps must be >= 2")
    if args.checkpoint_interval < 1:
        raise SystemExit("error: --checkpoint-interval must be >= 1")
    try:
        return run_demo(args)
    except DemoError as exc:
        print(f"error: {exc}")
        return 1
