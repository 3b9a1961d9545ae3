"""bench/gpu_check.py's CP attention check, on the CPU: the runtime's attention core of one CP
rank with the lower-right causal bias and with the same masks as boolean tensors gives the
same output and input gradients (the CPU materialises both), for cp 2 and 4."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_check


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_check_runs_the_runtime_core_on_the_cpu(cp):
    bias_s, boolean_s, difference = gpu_check.cp_attention_check(torch.device("cpu"), 512, cp,
                                                                 1)
    assert bias_s > 0 and boolean_s > 0
    assert difference == 0.0
