"""bench/chunked_loss.py end to end: both variants in their own processes, the chunked one's
peak resident memory far below the whole-sequence loss's, each near the cost model's bytes."""

from __future__ import annotations

from tests.bench.bench_run import run_bench, variant_rows


def test_the_bench_measures_the_chunked_loss_holding_a_fraction_of_the_whole_one():
    out = run_bench("chunked_loss.py", "--seq", "8192", "--hidden", "64", "--vocab", "8192",
                    "--chunk", "512", "--repeats", "1")
    rows = variant_rows(out)
    assert set(rows) == {"whole", "chunked"}, out
    (_, whole_rss, whole_model), (_, chunked_rss, chunked_model) = rows["whole"], rows["chunked"]
    # 8192 tokens × 8192 logits: the whole loss holds ~800 MB, a 512-token chunk 1/16 of it
    assert whole_model > 700 and chunked_model < whole_model / 8, out
    assert chunked_rss < whole_rss / 3, out
    # the measured peak near the model's bytes (the process's own allocations on top)
    assert 0.9 * whole_model < whole_rss < whole_model + 200, out
    assert "time chunked / whole: measured" in out
