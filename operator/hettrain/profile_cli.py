"""``hettrain profile``: measure the runtime's real layer on the local device, write a profile.

The command line side never imports torch: it checks its arguments and runs
``python -m hettrain.runtime.profile`` (the runtime side, which does) in a child process. The
profile YAML it writes is read by ``hettrain plan --profile FILE`` (``planning/profiles.py``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from hettrain.api.spec import JobSpec, SpecError, parse_job_manifest, short_repr
from hettrain.api.yamlsafe import YamlInputError, read_yaml_document

MAX_MICRO_BATCH = 4096  # --micro-batches: the largest size measured
MAX_MICRO_BATCHES = 32  # --micro-batches: the most sizes measured


class ProfileInputError(ValueError):
    """A ``hettrain profile`` input (the job, ``--out``) is unusable: a one-line message naming
    the file or flag and the fix (exit 2, before anything is measured)."""


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:  # not integers (or thousands of digits)
        values = []
    if (not values or min(values) < 1 or max(values) > MAX_MICRO_BATCH
            or len(set(values)) > MAX_MICRO_BATCHES):
        raise argparse.ArgumentTypeError(
            f"{short_repr(text)}: give positive integers up to {MAX_MICRO_BATCH} (at most "
            f"{MAX_MICRO_BATCHES} sizes), e.g. 1,2,4")
    return sorted(set(values))


def _device_name(text: str) -> str:
    if not text.strip() or text != text.strip() or not text.isprintable():
        raise argparse.ArgumentTypeError(
            f"{short_repr(text)}: give the catalog/cluster device name, e.g. CPU or H100-SXM")
    return text


MAX_REPEATS = 1000  # --repeats: timed runs per measurement (the median is taken)


def _repeats(text: str) -> int:
    try:
        value = int(text) if len(text) <= 30 else 0
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_REPEATS:
        raise argparse.ArgumentTypeError(f"{text[:30]!r}: give an integer from 1 to "
                                         f"{MAX_REPEATS}")
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
    parser.add_argument("--device-name", required=True, metavar="NAME", type=_device_name,
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


def load_job_spec(path: str) -> JobSpec:
    """The HetTrainingJob in ``path`` read through the bounded loader
    (:mod:`hettrain.api.yamlsafe`); raises :class:`ProfileInputError` naming the file."""
    try:
        doc = read_yaml_document(path)
        _, spec = parse_job_manifest(doc)
    except YamlInputError as exc:
        raise ProfileInputError(" ".join(str(exc).split())) from None
    except SpecError as exc:
        raise ProfileInputError(f"{path}: {' '.join(str(exc).split())}") from None
    return spec


def check_out(path: str) -> None:
    """Raise :class:`ProfileInputError` unless ``--out PATH`` can be written: not a directory,
    its directory exists and is writable (checked before the minutes of measuring)."""
    out = Path(path)
    if not path or out.is_dir():
        raise ProfileInputError(f"--out {path or repr(path)}: is a directory; give a file "
                                "path, e.g. profile.yaml")
    parent = out.parent
    if not parent.is_dir():
        raise ProfileInputError(f"--out {path}: directory {str(parent)!r} does not exist; "
                                "create it first")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ProfileInputError(f"--out {path}: is not writable; give a writable path")


def check_inputs(args: argparse.Namespace) -> JobSpec:
    """The job's spec once the job and ``--out`` are checked (:class:`ProfileInputError`)."""
    spec = load_job_spec(args.job)
    check_out(args.out)
    return spec


def run(args: argparse.Namespace) -> int:
    """Check the job and ``--out`` (bad input: one line on stderr, exit 2, nothing measured),
    then run the measurement in a child process; its exit code is ours."""
    try:
        check_inputs(args)
    except ProfileInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "hettrain.runtime.profile", args.job,
           "--device-name", args.device_name, "--out", args.out,
           "--micro-batches", ",".join(map(str, args.micro_batches)),
           "--repeats", str(args.repeats), *([] if args.comm else ["--no-comm"])]
    return subprocess.run(cmd, check=False).returncode
