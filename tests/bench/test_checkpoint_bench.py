"""bench/checkpoint.py runs end to end on a tiny model (its restores are checked inside)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import checkpoint as bench


def test_bench_reports_stall_throughput_and_restore(tmp_path):
    out = bench.main(["--hidden", "32", "--layers", "2", "--repeats", "1",
                      "--uri", str(tmp_path / "ck")])
    # params + two AdamW moments in fp32, at least
    model, _, _ = bench.build(bench.ModelSpec(layers=2, hidden=32, heads=8, seq_len=128,
                                              vocab=4096, ffn_hidden=128, kv_heads=4), 0, 2)
    assert out["state_bytes"] >= 3 * 4 * sum(p.numel() for p in model.parameters())
    for mode in ("sync", "async"):
        assert out[mode]["stall_s"] > 0 and out[mode]["throughput_Bps"] > 0
    assert out["restore_same_layout_s"] > 0 and out["restore_pp2_tp2_stage0_s"] > 0
