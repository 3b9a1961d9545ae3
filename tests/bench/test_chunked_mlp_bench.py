"""bench/chunked_mlp.py end to end: both variants of a full-recompute layer stack alternated in
one process, the chunked MLP's peak bytes well below the whole MLP's, each at most the cost
model's count and near it; and the ``--plans`` table's format."""

from __future__ import annotations

import re

from tests.bench.bench_run import run_bench, variant_rows


def test_the_bench_measures_the_chunked_mlp_holding_less_than_the_whole_one():
    out = run_bench("chunked_mlp.py", "--seq", "2048", "--hidden", "64", "--layers", "2",
                    "--chunk", "256", "--repeats", "1")
    rows = variant_rows(out)
    assert set(rows) == {"whole", "chunked"}, out
    for _, peak, model in rows.values():
        assert 0.85 * model <= peak <= model, out  # the model's count is a bound, and near
    assert rows["chunked"][1] < 0.75 * rows["whole"][1], out
    assert re.search(r"chunked / whole: time [\d.]+ \(GEMM FLOPs, cost model: 0\.\d\d\)", out)


def test_the_plans_table_lists_each_cluster_and_sequence():
    out = run_bench("chunked_mlp.py", "--plans", timeout=600)
    rows = re.findall(r"^\dx8 \S+\s+\d+k (full|attention-free)\s+(\d+) ->\s+(\d+)\s+"
                      r"([+-][\d.]+)%\s+chunk\s+(\d+)", out, re.M)
    assert len(rows) == 40, out
    for _, before, after, _, chunk in rows:
        assert int(after) >= int(before)  # plan_job keeps the faster of the two
        assert int(chunk) in (0, 4096)
