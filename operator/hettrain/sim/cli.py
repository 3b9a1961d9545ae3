"""``hettrain simulate``: goodput of repair policies under failures (hooked from hettrain.cli).

Protocol of :data:`hettrain.cli.EXTERNAL_COMMANDS`: :func:`add_arguments` fills the subparser,
:func:`run` returns the exit code (0 ok, 2 bad input with one line on stderr naming the flag or
field and the fix).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from hettrain.api.spec import SpecError
from hettrain.argtypes import float_in, int_in
from hettrain.planning.errors import PlanningError
from hettrain.planning.fields import MAX_DATACENTERS as MAX_DCS
from hettrain.planning.fields import MAX_GPUS_PER_NODE, MAX_POOL_NODES
from hettrain.sim.engine import POLICIES
from hettrain.sim.model import FailureModel, RecoveryModel, SimInputError, load_models
from hettrain.sim.scenarios import Scenario, preset

EXIT_OK, EXIT_USAGE = 0, 2
PRESETS = ("llama3-16k", "llama3-16k-nospares")
MAX_DAYS = 3650  # ten years of simulated training
MAX_SECONDS = 1e8  # about three years: any recovery or checkpoint duration
MAX_SEEDS = 1000
seconds = float_in(0, MAX_SECONDS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``hettrain simulate``."""
    parser.description = (
        "Discrete-event simulation of one training job under node, rack, datacenter and "
        "software failures and stragglers (sampled from a failure model, or replayed from a "
        "trace), comparing repair policies on the same failure timeline: restart (wait for a "
        "replacement, restart the same plan), replan (re-plan on survivors, grow back when "
        "nodes return), wait-shrink (wait when the replacement is due within a threshold, "
        "else shrink). Prints ETTR, goodput, hours lost by cause, re-plans and planner time.")
    src = parser.add_argument_group("what to simulate (one of)")
    one = src.add_mutually_exclusive_group(required=True)
    one.add_argument("--scenario", choices=PRESETS,
                     help="built-in scenario: llama3-16k (16,384 H100, 54 days, 32 spare nodes)"
                          " or llama3-16k-nospares")
    one.add_argument("--cluster", metavar="C.yaml", help="cluster description (kind: Cluster)")
    one.add_argument("--generate", metavar="GPUS:DEVICE[,...]",
                     help="generated cluster, e.g. 16384:H100-SXM or 8192:H100-SXM,4096:MI300X")
    src.add_argument("--job", metavar="J.yaml", help="HetTrainingJob manifest (required with "
                                                     "--cluster/--generate)")
    src.add_argument("--dcs", type=int_in(1, MAX_DCS), default=1,
                     help="--generate: datacenters (default 1)")
    src.add_argument("--gpus-per-node", type=int_in(1, MAX_GPUS_PER_NODE), default=8,
                     help="--generate: default 8")
    src.add_argument("--spare-nodes", type=int_in(0, MAX_POOL_NODES),
                     help="hot spares per pool, held out of every plan (default 0; with "
                          "--generate they are added to the GPU count, with --cluster they are "
                          "taken from each pool)")
    src.add_argument("--days", type=float_in(0, MAX_DAYS, lo_open=True),
                     help=f"simulated days (default 54, at most {MAX_DAYS})")
    fail = parser.add_argument_group("failures and recovery")
    fail.add_argument("--failures", metavar="F.yaml",
                      help="failure/recovery model (kind: FailureModel; defaults: Llama 3 rates,"
                           " see docs/simulator.md)")
    fail.add_argument("--trace", metavar="F.csv|F.jsonl",
                      help="replay this failure trace instead of sampling failures")
    fail.add_argument("--detection-s", type=seconds, help="seconds until a failure is noticed")
    fail.add_argument("--restart-s", type=seconds, help="seconds to restart the job")
    fail.add_argument("--plan-s", type=seconds, help="simulated seconds charged per re-plan")
    fail.add_argument("--storage-gbps", type=float_in(0, 1e6, lo_open=True),
                      help="checkpoint write bandwidth, GB/s")
    fail.add_argument("--ckpt-interval-s", type=float_in(0, MAX_SECONDS, lo_open=True),
                      help="training seconds between checkpoints (default: the Young-Daly optimum, "
                           "raised to make at most 10^6 checkpoints over --days)")
    fail.add_argument("--wait-threshold-s", type=seconds,
                      help="wait-shrink: wait if the replacement is due within this (s)")
    fail.add_argument("--repair-hours", type=float_in(0, MAX_SECONDS / 3600, lo_open=True),
                      help="mean time until a failed node is back (replacement arrival), hours")
    run_g = parser.add_argument_group("run")
    run_g.add_argument("--policies", default=",".join(POLICIES),
                       help=f"comma-separated, from {', '.join(POLICIES)} (default all)")
    run_g.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0,
                       help="first seed (default 0)")
    run_g.add_argument("--seeds", type=int_in(1, MAX_SEEDS), default=1,
                       help=f"number of seeds (default 1, at most {MAX_SEEDS})")
    run_g.add_argument("--quantum", type=int_in(1, MAX_POOL_NODES), default=1,
                       help="memoise plans by down nodes per pool rounded up to this (default 1"
                            " = exact)")
    run_g.add_argument("--timeout-s", type=float_in(0, 86400), metavar="SECONDS",
                       help="stop a plan that takes longer than SECONDS and exit 2 (0: no "
                            "limit; default: the operator's budget, "
                            "HETTRAIN_PLAN_TIMEOUT_SECONDS or 30)")
    run_g.add_argument("--throughput", default="planner", metavar="planner|scaled:K",
                       help="planner on the survivors (default) or plan a 1/K-size cluster "
                            "and scale tokens/s by K")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the report as JSON")
    pic = out.add_mutually_exclusive_group()
    pic.add_argument("--png", metavar="FILE", help="plot throughput over time (PNG)")
    pic.add_argument("--svg", metavar="FILE", help="same plot as SVG")


def _scenario(args: argparse.Namespace) -> Scenario:
    from hettrain.cli import load_inventory, load_job
    from hettrain.sim.cluster import generate_cluster

    if args.scenario:
        sc = preset(args.scenario)
        if args.job:
            raise SimInputError("--job", "a --scenario brings its own job; drop --job or use "
                                         "--generate/--cluster")
    else:
        if not args.job:
            raise SimInputError("--job", "is required with --cluster/--generate")
        name, spec = load_job(args.job)
        inv = (load_inventory(args.cluster) if args.cluster else
               generate_cluster(args.generate, dcs=args.dcs, gpus_per_node=args.gpus_per_node,
                                spare_nodes=args.spare_nodes or 0))
        label = args.cluster or f"generate {args.generate}"
        sc = Scenario(label, name, spec, inv, FailureModel(), RecoveryModel(), 54.0,
                      args.spare_nodes or 0)
    failures, recovery = sc.failures, sc.recovery
    if args.failures:
        failures, recovery = load_models(args.failures)
    if args.repair_hours is not None:
        if args.repair_hours <= 0:
            raise SimInputError("--repair-hours", f"must be > 0 (got {args.repair_hours})")
        failures = replace(failures, repair=replace(failures.repair,
                                                    mean_s=args.repair_hours * 3600))
    flags = {"detection_s": args.detection_s, "restart_s": args.restart_s,
             "plan_s": args.plan_s, "storage_gbps": args.storage_gbps,
             "checkpoint_interval_s": args.ckpt_interval_s,
             "wait_threshold_s": args.wait_threshold_s}
    for key, v in flags.items():
        if v is not None and (v < 0 or (key in ("storage_gbps", "checkpoint_interval_s")
                                        and v <= 0)):
            flag = "--" + key.replace("_", "-").replace("checkpoint-interval", "ckpt-interval")
            raise SimInputError(flag, f"must be > 0 (got {v})")
        if v is not None:
            recovery = replace(recovery, **{key: v})
            if key == "checkpoint_interval_s":
                recovery = replace(recovery, interval_field="--ckpt-interval-s")
    if args.scenario and args.spare_nodes is not None:
        raise SimInputError("--spare-nodes", "a --scenario fixes its spares (llama3-16k: 32, "
                                             "llama3-16k-nospares: 0); drop the flag")
    days = sc.days if args.days is None else args.days
    if days <= 0:
        raise SimInputError("--days", f"must be > 0 (got {days})")
    return replace(sc, failures=failures, recovery=recovery, days=days)


def _scale(text: str) -> int:
    if text == "planner":
        return 1
    kind, _, k = text.partition(":")
    if kind != "scaled" or not k.isdecimal() or len(k) > 9 or int(k) < 1:
        raise SimInputError("--throughput", f"must be planner or scaled:K with K >= 1 "
                                            f"(got {text!r})")
    return int(k)


def _plan_timeout(args: argparse.Namespace) -> float:
    """``--timeout-s``, else its default (:func:`hettrain.deadline.plan_timeout_default`)."""
    from hettrain.deadline import plan_timeout_default

    try:
        return plan_timeout_default(args.timeout_s)
    except ValueError as exc:
        raise SimInputError("environment", f"{exc}; unset it or give --timeout-s") from None


def run(args: argparse.Namespace) -> int:
    """Run ``hettrain simulate``; returns the exit code."""
    from hettrain.cli import CliError
    from hettrain.sim.run import format_report, run_scenario

    try:
        policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
        if args.seeds < 1:
            raise SimInputError("--seeds", f"must be >= 1 (got {args.seeds})")
        sc = _scenario(args)
        report = run_scenario(sc, policies=policies,
                              seeds=tuple(range(args.seed, args.seed + args.seeds)),
                              trace=args.trace, quantum=args.quantum,
                              scale=_scale(args.throughput),
                              plan_timeout_s=_plan_timeout(args))
    except (SimInputError, SpecError, PlanningError, CliError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    picture = args.png or args.svg
    if picture:
        try:
            from hettrain.sim.plot import render_throughput

            render_throughput(report, picture, fmt="png" if args.png else "svg")
        except ModuleNotFoundError as exc:
            print(f"error: --png/--svg need the Python package {exc.name!r}; install it with: "
                  "pip install 'hettrain[viz]'", file=sys.stderr)
            return EXIT_USAGE
        except OSError as exc:
            print(f"error: {picture}: cannot write the plot: {exc.strerror or exc}",
                  file=sys.stderr)
            return EXIT_USAGE
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        print(format_report(report))
        if picture:
            print(f"plot written to {picture}")
    return EXIT_OK
