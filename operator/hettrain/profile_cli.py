"""``hettrain profile``: measure the runtime's real layer on the local device, write a profile.

The command line side never imports torch: it checks its arguments and runs
``python -m hettrain.runtime.profile`` (the runtime side, which does) in a child process. The
profile YAML it writes is read by ``hettrain plan --profile FILE`` (``planning/profiles.py``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,2,4")
    return sorted(set(values))


def _repeats(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``hettrain profile`` (shared with ``python -m hettrain.runtime.profile``)."""
    parser.description = (
        "Run the runtime's transformer block of a job's model on this machine's device (CUDA "
        "when available, else CPU) in the job's precision for a few microbatch sizes and write "
        "a versioned DeviceProfile YAML (median forward and backward seconds per layer without "
        "recompute and forward+backward with selective and full recompute, the optimizer "
        "step's bandwidth, and two local ranks' p2p and all-reduce times). "
        "`hettrain plan --profile FILE` then uses the measured layer times for that device, "
        "model shape and precision, and the plan notes say so.")
    parser.add_argument("job", metavar="JOB.yaml", help="HetTrainingJob whose spec.model to run")
    parser.add_argument("--device-name", required=True, metavar="NAME",
                        help="catalog/cluster device name the profile is for, e.g. CPU, H100-SXM")
    parser.add_argument("--out", required=True, metavar="FILE", help="profile YAML to write")
    parser.add_argument("--micro-batches", type=_positive_ints, default=[1, 2, 4],
                        metavar="B,B,...", help="microbatch sizes to measure (default 1,2,4)")
    parser.add_argument("--repeats", type=_repeats, default=5, metavar="N",
                        help="timed runs per size; the median is kept (default 5)")
    parser.add_argument("--no-comm", dest="comm", action="store_false",
                        help="skip the communication measurement (two local ranks' pipeline "
                             "transfers and all-reduce; skipped anyway where this node has "
                             "one accelerator)")


def run(args: argparse.Namespace) -> int:
    """Run the measurement in a child process; its exit code is ours."""
    cmd = [sys.executable, "-m", "hettrain.runtime.profile", args.job,
           "--device-name", args.device_name, "--out", args.out,
           "--micro-batches", ",".join(map(str, args.micro_batches)),
           "--repeats", str(args.repeats), *([] if args.comm else ["--no-comm"])]
    return subprocess.run(cmd, check=False).returncode
