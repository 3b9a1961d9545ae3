"""Plan rendering: the rich table's content and the SVG/PNG picture's elements."""

from __future__ import annotations

import dataclasses
import io
import struct
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from matplotlib.image import imread

from hettrain.planning.plan import Plan
from hettrain.render.figure import render_plan_figure
from hettrain.render.table import human_bytes, layout_summary, print_plan, stage_layers

SVG_NS = "{http://www.w3.org/2000/svg}"


def svg_ids(path: Path) -> list[str]:
    """Every element id in an SVG file (parsed as XML, so it must be well-formed)."""
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG_NS}svg"
    return [el.get("id", "") for el in root.iter()]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_table_shows_every_stage_summary_and_notes(make_plan: Callable[..., Plan]) -> None:
    plan = make_plan(pp=4, dp=2, microbatches=8)
    buf = io.StringIO()
    print_plan(plan, file=buf, width=160)
    text = buf.getvalue()
    for s in plan.stages:
        row = next(line for line in text.splitlines() if line.startswith(f"│     {s.index} │"))
        for cell in (s.device, s.vendor, s.pools[0], s.datacenters[0], str(s.layers),
                     f"{s.memory_gib:.1f}/{s.capacity_gib:.0f}", f"{s.time_ms:.1f}"):
            assert cell in row, (cell, row)
        assert f"{s.layer_start}–{s.layer_end - 1}" in row
    assert "+emb" in text and "+head" in text
    assert f"{plan.world_size} ranks" in text
    assert layout_summary(plan) == "2×4×{8,4,2}"
    assert "2×4×{8,4,2}" in text
    assert "1 seq × 8 per replica (global batch 16)" in text
    assert "52.4k" in text and "41.0%" in text and "3.5 GiB" in text
    assert plan.fingerprint() in text
    for note in plan.notes:
        assert note in text


def test_human_bytes() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 2**40) == "3.0 TiB"


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "v", "bars_per_mb_stage"),
    [("1f1b", 4, 8, 1, 2), ("zb-h1", 3, 6, 1, 3), ("interleaved", 3, 6, 2, 4)],
)
def test_svg_has_one_cell_per_gpu_and_one_bar_per_operation(
    tmp_path: Path, make_plan: Callable[..., Plan], schedule: str, pp: int, m: int, v: int,
    bars_per_mb_stage: int,
) -> None:
    plan = make_plan(pp=pp, dp=2, microbatches=m, schedule=schedule, virtual_stages=v)
    out = tmp_path / "plan.svg"
    timeline = render_plan_figure(plan, out)
    assert timeline is not None
    ids = svg_ids(out)
    cells = [i for i in ids if i.startswith("gpu-r")]
    assert sorted(cells) == sorted(f"gpu-r{r.rank}" for r in plan.ranks)
    bars = [i for i in ids if i.startswith("gantt-")]
    assert len(bars) == bars_per_mb_stage * pp * m  # 2·pp·m for 1F1B
    kinds = Counter(b.split("-")[1] for b in bars)
    assert kinds["F"] == pp * m * v
    assert kinds["B"] == pp * m * v
    assert kinds["W"] == (pp * m if schedule == "zb-h1" else 0)
    text = out.read_text()
    for s in plan.stages:
        assert s.device in text  # stage labels and legend
    for node in plan.nodes():
        assert node in text


def test_png_is_readable_and_sized_to_the_plan(tmp_path: Path,
                                               make_plan: Callable[..., Plan]) -> None:
    small, big = tmp_path / "small.png", tmp_path / "big.png"
    render_plan_figure(make_plan(pp=2, dp=1, microbatches=4), small)
    render_plan_figure(make_plan(pp=4, dp=4, microbatches=8), big)
    (w1, h1), (w2, h2) = png_size(small), png_size(big)
    assert w1 == w2 == 14 * 110  # 14 inches at 110 dpi
    assert h2 > h1  # more stages and nodes: a taller picture
    pixels = imread(big)
    assert pixels.shape[:2] == (h2, w2)
    assert pixels.std() > 0.05  # not blank


def test_undrawable_schedule_still_writes_the_map(tmp_path: Path,
                                                  make_plan: Callable[..., Plan]) -> None:
    plan = make_plan(pp=3, dp=1, microbatches=4, schedule="interleaved", virtual_stages=2)
    out = tmp_path / "plan.svg"
    assert render_plan_figure(plan, out) is None
    ids = svg_ids(out)
    assert sum(i.startswith("gpu-r") for i in ids) == plan.world_size
    assert not any(i.startswith("gantt-") for i in ids)
    assert "schedule not drawn" in out.read_text()


def test_bad_picture_format_names_the_fix(tmp_path: Path, make_plan: Callable[..., Plan]) -> None:
    with pytest.raises(ValueError, match=r"\.svg or \.png"):
        render_plan_figure(make_plan(), tmp_path / "plan.gif")


def test_interleaved_stages_show_the_chunks_they_hold(make_plan: Callable[..., Plan]) -> None:
    plan = make_plan(pp=3, dp=1, microbatches=6, schedule="interleaved", virtual_stages=2)
    counts = [s.layer_end - s.layer_start for s in plan.stages]
    # independent walk of the chunk-major order: chunk c of every stage, then chunk c+1
    nxt, held = 0, [[] for _ in counts]
    for c in range(2):
        for s, n in enumerate(counts):
            k = n // 2 + (n % 2 if c == 0 else 0)  # near-equal, the first chunk takes the rest
            held[s].append(f"{nxt}" if k == 1 else f"{nxt}–{nxt + k - 1}")
            nxt += k
    assert nxt == plan.model.layers
    assert stage_layers(plan) == [", ".join(h) for h in held]
    out = io.StringIO()
    print_plan(plan, file=out, width=200)
    assert all(", ".join(h) in out.getvalue() for h in held)
    plain = make_plan(pp=3, dp=1, microbatches=4)
    assert stage_layers(plain) == [f"{s.layer_start}–{s.layer_end - 1}" for s in plain.stages]


def test_layout_stage_rows_and_picture_name_the_cp_degree(
        tmp_path: Path, make_plan: Callable[..., Plan]) -> None:
    plan = make_plan(pp=2, dp=1, microbatches=2)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, cp=4)
                                                  for s in plan.stages))
    assert layout_summary(plan).endswith(" (cp 4)")
    buf = io.StringIO()
    print_plan(plan, file=buf)
    assert " cp4 " in buf.getvalue()
    out = tmp_path / "plan.svg"
    render_plan_figure(plan, out)
    text = out.read_text()
    assert "(cp 4)" in text  # the title's layout
    for s in plan.stages:  # the legend's stage entries
        assert f"stage {s.index}: {s.device} tp{s.tp} cp4, layers" in text


def test_replica_groups_show_in_the_table_and_the_picture(tmp_path: Path) -> None:
    from tests.operator.optest_helpers import hetero_nodes, job_body, make_node

    from hettrain.api.spec import parse_job_spec
    from hettrain.planning.inventory import inventory_from_nodes
    from hettrain.planning.planner import plan_job

    body = job_body()["spec"]
    # enough tokens per step that the MI300X group outweighs the gradient sum between groups
    body["training"] = {**body["training"], "globalBatch": 2048}
    body["parallelism"] = {"tp": 1, "pp": 2, "dp": 8, "schedule": "zb-h1",
                           "replicaGroups": True}
    amd = [make_node(f"mi300-{i:03d}", "mi300", "MI300X", "amd", 8, "dc-a") for i in range(2)]
    plan = plan_job("job1", parse_job_spec(body), inventory_from_nodes(hetero_nodes(2, 0) + amd))
    assert len(plan.groups) == 2
    g0, g1 = plan.groups
    summary = layout_summary(plan)
    assert summary == f"8×2×1 + {g1.dp}×{g1.pp}×1 (2 replica groups)", summary
    buf = io.StringIO()
    print_plan(plan, file=buf, width=200)
    text = buf.getvalue()
    assert summary in text
    assert (f"{plan.micro_batch} seq × {g0.num_microbatches} (group 0) / "
            f"{g1.num_microbatches} (group 1) per replica (global batch {plan.global_batch})"
            ) in text
    for g in plan.groups:  # one row per (group, stage), with the group's own DP degree
        for s in g.stages:
            row = next(line for line in text.splitlines()
                       if line.startswith(f"│     {g.index} │     {s.index} │"))
            assert s.device in row and row.rstrip("│ ").split("│")[-3].strip() == str(g.dp), row
    out = tmp_path / "groups.svg"
    render_plan_figure(plan, out)
    ids = svg_ids(out)
    assert sorted(i for i in ids if i.startswith("gpu-r")) == sorted(
        f"gpu-r{r.rank}" for r in plan.ranks)  # group 1's GPUs are drawn too
    picture = out.read_text()
    assert "group 1 stage 0" in picture and "group 0 stage 1" in picture
    # the step-time parts are the critical group's: none exceeds the step
    p = plan.predicted
    assert p.compute_s + p.bubble_s <= p.step_time_s + 1e-9, p


def test_helix_plans_draw_every_part_where_it_runs(tmp_path: Path) -> None:
    """A pinned helix plan's Gantt: one bar per part of every layer of every microbatch (F/B
    for the parameter parts, A/a for the attention cores), on the stage the order runs it,
    timed as the order replayed with the plan's stage times."""
    from hettrain.api.spec import parse_job_spec
    from hettrain.planning import helix
    from hettrain.planning.inventory import load_cluster
    from hettrain.planning.planner import plan_job
    from hettrain.render.figure import plan_timeline

    inv = load_cluster({"apiVersion": "hettrain.dev/v1alpha1", "kind": "Cluster",
                        "metadata": {"name": "c"}, "datacenters": [{"name": "a"}],
                        "pools": [{"name": "h", "datacenter": "a", "device": "H100-SXM",
                                   "nodes": 1, "gpusPerNode": 4, "nicGbps": 400}]})
    spec = parse_job_spec({"model": {"layers": 8, "hidden": 1024, "heads": 16,
                                     "seqLen": 32768, "vocab": 32000},
                           "training": {"globalBatch": 4, "steps": 1,
                                        "recompute": "attention-free"},
                           "parallelism": {"schedule": "helix", "pp": 4}})
    plan = plan_job("j", spec, inv)
    assert plan.schedule == "helix"
    timeline = plan_timeline(plan)
    layers, m = plan.model.layers, plan.num_microbatches
    assert Counter(o.kind for o in timeline.ops) == {"F": 2 * layers * m, "B": 2 * layers * m,
                                                     "A": layers * m, "a": layers * m}
    orders = helix.helix_orders(plan.pp, layers, m, helix.costs_for(plan.model),
                                plan.helix_hop)
    cores = Counter((o.microbatch, o.chunk, o.stage) for o in timeline.ops if o.kind == "A")
    assert cores == Counter((j, k // plan.pp, s) for (j, k), s in
                            helix.placement(orders).items())
    costs = helix.costs_for(plan.model)
    unit = [s.time_ms / (layers / plan.pp) / sum(costs.values()) for s in plan.stages]
    want = helix.makespan(orders, layers, [{k: c * u for k, c in costs.items()} for u in unit])
    assert timeline.makespan_ms == pytest.approx(want, rel=1e-9)
    out = tmp_path / "helix.svg"
    render_plan_figure(plan, out)
    ids = svg_ids(out)
    assert sum(i.startswith("gantt-") for i in ids) == 6 * layers * m
    assert "attention core" in out.read_text()
