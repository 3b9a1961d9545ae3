"""bench/checkpoint.py runs end to end on a tiny model (its restores are checked inside)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

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
    # saved by a pp2/dp1 job (two stage files), restored by every rank of other layouts: the
    # state each layout fills is the saved state times its replicas (TP shards split it)
    saved = out["save_pp2_dp1"]
    assert saved["seconds"] > 0 and saved["throughput_Bps"] > 0
    # each element stored once, by its stage (the two files differ only in their headers)
    assert saved["bytes"] == pytest.approx(out["state_bytes"], rel=1e-3)
    layouts = out["restore_from_pp2_dp1"]
    assert set(layouts) == {"pp2 dp1 (as saved)", "pp1 dp2", "pp2 dp1 tp2"}
    assert layouts["pp2 dp1 (as saved)"]["ratio_to_as_saved"] == 1.0
    for row in layouts.values():
        assert row["seconds"] > 0 and row["throughput_Bps"] > 0
    # (up to the per-rank RNG state, 5 KB)
    assert layouts["pp1 dp2"]["bytes"] == pytest.approx(
        2 * layouts["pp2 dp1 (as saved)"]["bytes"], rel=1e-2)
    assert layouts["pp2 dp1 tp2"]["bytes"] >= layouts["pp2 dp1 (as saved)"]["bytes"]
