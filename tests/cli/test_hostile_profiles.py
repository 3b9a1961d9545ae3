"""Hostile device profiles and ``hettrain profile`` arguments through the real CLI (a subprocess
with a timeout): every one ends in exit 2 with one line on stderr naming the file or flag and
the field, no traceback, no hang; ``hettrain profile`` refuses before it measures anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from tests.cli.hostile import ROOT, assert_clean_refusal, run_hettrain

JOB = ROOT / "examples/jobs/gpt-tiny-local.yaml"
CLUSTER = ROOT / "examples/clusters/local-cpu.yaml"

GOOD_PROFILE = """\
kind: DeviceProfile
version: 2
device: CPU
precision: fp32
model: {hidden: 64, heads: 4, kvHeads: 4, ffnHidden: 256, seqLen: 64, gatedMlp: false, vocab: 256}
layer:
  - {microBatch: 1, forwardS: 0.001, backwardS: 0.002}
  - {microBatch: 2, forwardS: 0.002, backwardS: 0.004}
"""
ROW = "{microBatch: 1, forwardS: 0.001, backwardS: 0.002}"
INF_ROW = "{microBatch: .inf, forwardS: 0.001, backwardS: 0.002}"
BOMB = "  a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"  {chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n"
    for i in range(9))
# a sitecustomize that makes ``import torch`` fail: a `hettrain profile` that went on to
# measure (the runtime imports torch) would end in a traceback instead of a clean refusal
NO_TORCH = """\
import sys


class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked by the test: nothing may be measured")
        return None


sys.meta_path.insert(0, _NoTorch())
"""


def _hettrain(argv: list[str], tmp_path: Path, *, block_torch: bool = False
              ) -> subprocess.CompletedProcess[str]:
    """``hettrain ARGV`` as a new process; with ``block_torch`` neither it nor a child it
    starts can import torch."""
    first = []
    if block_torch:
        site = tmp_path / "no-torch"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(NO_TORCH)
        first.append(str(site))
    return run_hettrain(argv, tmp_path, path_first=first)


def _plan(profile: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return _hettrain(["plan", str(JOB), "--cluster", str(CLUSTER), "--profile", str(profile)],
                     tmp_path)


def test_the_good_profile_plans(tmp_path: Path) -> None:
    """The profile every hostile case below starts from is valid (exit 0)."""
    path = tmp_path / "p.yaml"
    path.write_text(GOOD_PROFILE)
    proc = _plan(path, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]


PROFILE_CASES = {
    # 1: the file itself, read through the bounded loader
    "non-UTF-8 file": (GOOD_PROFILE.encode() + b"software: {torch: \xff\xfe}\n",
                       ("--profile", "p.yaml", "UTF-8")),
    "deep nesting": ("kind: " + "[" * 20_000 + "]" * 20_000 + "\n",
                     ("--profile", "p.yaml", "deeper")),
    "5000-digit integer": (GOOD_PROFILE.replace("hidden: 64,", f"hidden: {'9' * 5000},"),
                           ("--profile", "p.yaml", "digits")),
    "alias bomb under software": (GOOD_PROFILE + "software:\n" + BOMB,
                                  ("--profile", "p.yaml", "alias")),
    # 2: malformed values of a valid v2 profile, each named
    "precision list": (GOOD_PROFILE.replace("precision: fp32", "precision: [fp32]"),
                       ("--profile", "p.yaml.precision")),
    "stage layers list": (GOOD_PROFILE + "stage: [{microBatch: 1, layers: [1], middleS: 0.004, "
                          "firstS: 0.005, lastS: 0.006}]\n",
                          ("--profile", "p.yaml.stage[].layers")),
    "infinite layer microBatch": (GOOD_PROFILE.replace("microBatch: 2,", "microBatch: .inf,"),
                                  ("p.yaml.layer[1]", "microBatch")),
    "infinite tp microBatch": (GOOD_PROFILE + f"tp: [{{tp: 2, layer: [{ROW}, {INF_ROW}]}}]\n",
                               ("p.yaml.tp[0].layer[1]", "microBatch")),
    "infinite concurrent microBatch": (
        GOOD_PROFILE + f"concurrent: {{ranks: 2, layer: [{INF_ROW}]}}\n",
        ("p.yaml.concurrent.layer[0]", "microBatch")),
    "infinite forwardS": (GOOD_PROFILE.replace("forwardS: 0.002,", "forwardS: .inf,"),
                          ("p.yaml.layer[1]", "forwardS")),
    "NaN forwardS": (GOOD_PROFILE.replace("forwardS: 0.002,", "forwardS: .nan,"),
                     ("p.yaml.layer[1]", "forwardS")),
    "extreme comm row": (GOOD_PROFILE + "comm: {ranks: 2, backend: gloo, p2p: [{bytes: 4096, "
                         "seconds: 1.0e-4}, {bytes: 1.0e300, seconds: 1.0e-300}], allReduce: "
                         "[{bytes: 4096, seconds: 1.0e-4}, {bytes: 1048576, seconds: 1.0e-3}]}\n",
                         ("p.yaml.comm.p2p[1]", "bytes")),
    "tiny optimizer bandwidth": (GOOD_PROFILE + "optimizerBytesPerS: 1.0e-300\n",
                                 ("p.yaml.optimizerBytesPerS",)),
}


@pytest.mark.parametrize("case", list(PROFILE_CASES))
def test_plan_refuses_a_hostile_profile(case: str, tmp_path: Path) -> None:
    text, needles = PROFILE_CASES[case]
    path = tmp_path / "p.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    assert_clean_refusal(_plan(path, tmp_path), *needles)


PROFILE_ARG_CASES = {
    # 3: the job read through the bounded loader
    "non-UTF-8 job": ({"job": b"kind: HetTrainingJob\nmetadata: {name: \xff}\n"},
                      ("job.yaml", "UTF-8")),
    "deeply nested job": ({"job": "spec: " + "[" * 20_000 + "]" * 20_000 + "\n"},
                          ("job.yaml", "deeper")),
    # and the arguments, checked before measuring
    "--out a directory": ({"out": "."}, ("--out", "directory")),
    "--out in a missing directory": ({"out": "missing/p.yaml"}, ("--out", "does not exist")),
    "--micro-batches too large": ({"micro_batches": "1,100000"}, ("--micro-batches", "4096")),
    "--device-name empty": ({"device_name": ""}, ("--device-name",)),
    "--repeats 10^12": ({"repeats": "1000000000000"}, ("--repeats", "1000")),
}


@pytest.mark.parametrize("case", list(PROFILE_ARG_CASES))
def test_profile_refuses_before_measuring(case: str, tmp_path: Path) -> None:
    edit, needles = PROFILE_ARG_CASES[case]
    job = tmp_path / "job.yaml"
    text = edit.get("job", JOB.read_text())
    if isinstance(text, bytes):
        job.write_bytes(text)
    else:
        job.write_text(text)
    argv = ["profile", str(job), "--device-name", edit.get("device_name", "CPU"),
            "--out", edit.get("out", "p.yaml"), "--micro-batches", edit.get("micro_batches", "1"),
            "--repeats", edit.get("repeats", "1"), "--no-comm"]
    proc = _hettrain(argv, tmp_path, block_torch=True)
    assert_clean_refusal(proc, *needles)
    assert not (tmp_path / "p.yaml").exists()


def test_the_torch_block_would_catch_a_measurement(tmp_path: Path) -> None:
    """Valid arguments get as far as the runtime (which imports torch) and fail there: the
    refusals above happened before measuring."""
    argv = ["profile", str(JOB), "--device-name", "CPU", "--out", "p.yaml", "--micro-batches",
            "1", "--repeats", "1", "--no-comm"]
    proc = _hettrain(argv, tmp_path, block_torch=True)
    assert proc.returncode != 0 and "torch is blocked by the test" in proc.stderr
    assert not (tmp_path / "p.yaml").exists()
