"""Picture of a plan (SVG or PNG): where every rank runs, and one replica's pipeline schedule.

Panel 1, the placement map: datacenter → pool → node, one cell per GPU, coloured by the pipeline
stage of the rank on it. Panel 2, the Gantt chart: one row per stage, one bar per forward (F),
backward (B) and, for ZB-H1, weight-gradient (W) operation of one replica's step, timed by
:mod:`hettrain.render.schedule` from the plan's stage times (compute only).

Artists carry SVG ids so the output can be checked: ``gpu-r<rank>`` for placement cells and
``gantt-<kind>-s<stage>-m<microbatch>-c<chunk>`` for schedule bars. Drawn with matplotlib's
object API on an Agg canvas (no pyplot, no display needed).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from hettrain.api.spec import chunked_schedule
from hettrain.planning import helix
from hettrain.planning.plan import Plan, RankPlan
from hettrain.render.schedule import (
    BACKWARD,
    CORE,
    CORE_BACKWARD,
    FORWARD,
    SCHEDULE_NAMES,
    WEIGHT,
    Timeline,
    build_timeline,
    helix_timeline,
)
from hettrain.render.table import group_stages, layout_summary, schedule_summary

FORMATS = ("svg", "png")
NODES_PER_ROW = 8
KIND_STYLE = {  # face colour, label
    FORWARD: ("#4c78a8", "forward"),
    BACKWARD: ("#54a24b", "backward"),
    WEIGHT: ("#f2a93b", "weight grad"),
    CORE: ("#b279a2", "attention core"),
    CORE_BACKWARD: ("#e45756", "attention core backward"),
}


def stage_colors(stages: int) -> list[tuple[float, float, float, float]]:
    """Distinct colours for ``stages`` pipeline stages."""
    name = "tab10" if stages <= 10 else "tab20"
    cmap = colormaps[name]
    if stages <= cmap.N:
        return [cmap(i) for i in range(stages)]
    return [colormaps["hsv"](i / stages) for i in range(stages)]


def plan_timeline(plan: Plan) -> Timeline:
    """The Gantt schedule of one replica of ``plan``."""
    if plan.schedule == "helix":
        return helix_timeline([s.time_ms for s in plan.stages], plan.num_microbatches,
                              plan.model.layers, helix.costs_for(plan.model), plan.helix_hop,
                              filo=plan.helix_filo)
    chunks = plan.virtual_stages if chunked_schedule(plan.schedule) else 1
    schedule = plan.schedule if plan.schedule in SCHEDULE_NAMES else "1f1b"
    return build_timeline(
        [s.time_ms for s in plan.stages], plan.num_microbatches, schedule, chunks=chunks,
        link_warmup=[s.link_warmup for s in plan.stages] if schedule in ("1f1b", "zb-h1")
        else (),
    )


def _group_ranks(plan: Plan) -> dict[str, dict[str, dict[str, list[RankPlan]]]]:
    """datacenter → pool → node → ranks, each level in first-rank order."""
    tree: dict[str, dict[str, dict[str, list[RankPlan]]]] = {}
    for r in sorted(plan.ranks, key=lambda r: r.rank):
        tree.setdefault(r.datacenter, {}).setdefault(r.pool, {}).setdefault(r.node, []).append(r)
    return tree


def _placement_rows(plan: Plan) -> int:
    rows = 0
    for pools in _group_ranks(plan).values():
        rows += 1  # datacenter header
        for nodes in pools.values():
            rows += -(-len(nodes) // NODES_PER_ROW)
    return rows


def draw_placement(ax: Axes, plan: Plan) -> int:
    """Draw the placement map on ``ax``; returns the number of GPU cells drawn."""
    stages = group_stages(plan)  # every replica group's stages, one colour each
    palette = stage_colors(len(stages))
    colors = {(g, s.index): palette[i] for i, (g, _, s, _) in enumerate(stages)}
    pool_device = {p: s.device for _, _, s, _ in stages for p in s.pools}
    gpus_per_node = max((r.local_rank + 1 for r in plan.ranks), default=1)
    node_w = gpus_per_node + 1.0  # one cell of gap between nodes
    cells = 0
    y = 0.0
    for dc, pools in _group_ranks(plan).items():
        ax.text(-0.5, y + 0.2, f"datacenter {dc}", ha="left", va="center", fontsize=10,
                fontweight="bold")
        y += 1
        for pool, nodes in pools.items():
            gpus = sum(len(v) for v in nodes.values())
            ax.text(-0.5, y + 0.45, f"{pool}\n{pool_device.get(pool, '?')} · {gpus} GPUs",
                    ha="right", va="center", fontsize=8)
            for i, (node, ranks) in enumerate(nodes.items()):
                row, col = divmod(i, NODES_PER_ROW)
                x0, y0 = col * node_w, y + row
                ax.add_artist(Rectangle((x0 - 0.1, y0 - 0.05), gpus_per_node + 0.2, 0.95,
                                       fill=False, edgecolor="#555555", linewidth=0.6))
                for r in ranks:
                    cell = Rectangle((x0 + r.local_rank, y0 + 0.05), 0.9, 0.6,
                                     facecolor=colors[(r.group, r.stage)], edgecolor="white",
                                     linewidth=0.3)
                    cell.set_gid(f"gpu-r{r.rank}")
                    cell.set_in_layout(False)  # inside the axes; keeps layout fast
                    ax.add_artist(cell)
                    cells += 1
                first, last = ranks[0].rank, ranks[-1].rank
                span = f"r{first}" if first == last else f"r{first}–{last}"
                ax.text(x0 + gpus_per_node / 2, y0 + 0.8, f"{node}  {span}", ha="center",
                        va="center", fontsize=5.5, color="#333333")
            y += -(-len(nodes) // NODES_PER_ROW)
    widest = max((min(len(nodes), NODES_PER_ROW) for pools in _group_ranks(plan).values()
                  for nodes in pools.values()), default=1)
    ax.set_xlim(-0.5, max(widest, 4) * node_w)
    ax.set_ylim(y + 0.2, -0.4)
    ax.set_axis_off()
    legend = [Patch(facecolor=colors[(g, s.index)],
                    label=(f"group {g} " if plan.groups else "") + f"stage {s.index}: "
                    f"{s.device} tp{s.tp}{f' cp{s.cp}' if s.cp > 1 else ''}, layers {label}")
              for g, _, s, label in stages]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
              frameon=False, title="placement", title_fontsize=8)
    ax.set_title(f"{plan.job}: {plan.world_size} GPUs, DP×PP×TP = {layout_summary(plan)}",
                 loc="left", fontsize=11)
    return cells


def _bar_color(base: str, chunk: int, chunks: int) -> tuple[float, float, float, float]:
    """``base`` for the first model chunk, lighter for later ones (interleaved schedule)."""
    r, g, b, _ = to_rgba(base)
    fade = 0.55 * chunk / chunks
    return (r + (1 - r) * fade, g + (1 - g) * fade, b + (1 - b) * fade, 1.0)


def draw_gantt(ax: Axes, plan: Plan, timeline: Timeline) -> int:
    """Draw one replica's pipeline schedule on ``ax``; returns the number of bars drawn."""
    colors = stage_colors(plan.pp)
    makespan = timeline.makespan_ms or 1.0
    label_bars = len(timeline.ops) <= 400
    edge = 0.4 if label_bars else 0.0  # thousands of thin bars: white edges would hide them
    for op in timeline.ops:
        face = _bar_color(KIND_STYLE[op.kind][0], op.chunk, timeline.chunks)
        bar = Rectangle((op.start_ms, op.stage - 0.38), op.duration_ms, 0.76, facecolor=face,
                        edgecolor="white", linewidth=edge)
        bar.set_gid(f"gantt-{op.kind}-s{op.stage}-m{op.microbatch}-c{op.chunk}")
        bar.set_in_layout(False)
        ax.add_artist(bar)
        if label_bars and op.duration_ms / makespan > 0.012:
            ax.text(op.start_ms + op.duration_ms / 2, op.stage, str(op.microbatch),
                    ha="center", va="center", fontsize=6, color="white")
    ax.set_xlim(0, makespan * 1.01)
    ax.set_ylim(plan.pp - 0.5, -0.5)
    ax.set_yticks(range(plan.pp))
    ax.set_yticklabels([f"stage {s.index} · {s.device}" for s in plan.stages], fontsize=8)
    for tick, color in zip(ax.get_yticklabels(), colors, strict=True):
        tick.set_color(color)
    ax.set_xlabel("time in one optimizer step (ms, compute only)")
    kinds = [FORWARD, BACKWARD] + [k for k in (WEIGHT, CORE, CORE_BACKWARD)
                                   if any(o.kind == k for o in timeline.ops)]
    ax.legend(handles=[Patch(facecolor=KIND_STYLE[k][0], label=KIND_STYLE[k][1]) for k in kinds],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False,
              title="operation", title_fontsize=8)
    ax.set_title(
        f"pipeline schedule, one replica: {schedule_summary(plan)}, "
        f"{plan.num_microbatches} microbatches; makespan {makespan:.0f} ms, "
        f"bubble {100 * (1 - timeline.busy_fraction()):.0f}%",
        loc="left", fontsize=10,
    )
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    return len(timeline.ops)


def render_plan_figure(plan: Plan, path: str | Path, fmt: str | None = None) -> Timeline | None:
    """Write the two-panel picture of ``plan`` to ``path`` as SVG or PNG.

    ``fmt`` defaults to the file's extension. Returns the drawn timeline, or None when the
    schedule cannot be drawn (the panel then says why). Raises ``ValueError`` for a bad format.
    """
    path = Path(path)
    fmt = (fmt or path.suffix.lstrip(".")).lower()
    if fmt not in FORMATS:
        raise ValueError(f"picture format must be one of {', '.join(FORMATS)} (got {fmt!r} "
                         f"for {path}); use a .svg or .png file name")
    map_rows = _placement_rows(plan)
    map_h = 0.9 + 0.42 * map_rows
    gantt_h = 1.4 + 0.38 * plan.pp
    fig = Figure(figsize=(14, map_h + gantt_h), layout="constrained")
    FigureCanvasAgg(fig)
    ax_map, ax_gantt = fig.subplots(2, 1, height_ratios=[map_h, gantt_h])
    draw_placement(ax_map, plan)
    timeline: Timeline | None
    try:
        timeline = plan_timeline(plan)
    except ValueError as err:
        timeline = None
        ax_gantt.set_axis_off()
        ax_gantt.text(0.0, 0.5, f"schedule not drawn: {err}", fontsize=10, va="center")
    if timeline is not None:
        draw_gantt(ax_gantt, plan, timeline)
    fig.savefig(path, format=fmt, dpi=110)
    return timeline

