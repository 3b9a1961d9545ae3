"""Terminal view of a plan: a per-stage table, a summary and the planner's notes (rich)."""

from __future__ import annotations

from typing import IO

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from hettrain.api.spec import chunked_schedule
from hettrain.planning.layers import chunk_layer_ranges
from hettrain.planning.plan import Plan, StagePlan
from hettrain.planning.support import group_cp


def human_bytes(n: float) -> str:
    """``1536`` → ``1.5 KiB``; binary units, one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_rate(tokens_per_s: float) -> str:
    """``123456`` → ``123.5k``."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f}{suffix}"
    return f"{tokens_per_s:.1f}"


def tp_summary(plan: Plan) -> str:
    """The TP degree, or the per-stage degrees when stages differ (``{8,4}``)."""
    return _tp_of(plan.stages)


def layout_summary(plan: Plan) -> str:
    """``DP×PP×TP``, e.g. ``2×4×8``; with context parallelism ``2×4×2 (cp 4)``; with replica
    groups each group's, e.g. ``8×2×1 + 16×1×1 (2 replica groups)``."""
    base = f"{plan.dp}×{plan.pp}×{tp_summary(plan)}" + _cp_of(plan.stages)
    if not plan.groups:
        return base
    rest = " + ".join(f"{g.dp}×{g.pp}×{_tp_of(g.stages)}{_cp_of(g.stages)}"
                      for g in plan.groups[1:])
    return f"{base} + {rest} ({len(plan.groups)} replica groups)"


def _cp_of(stages: tuple[StagePlan, ...]) -> str:
    """`` (cp N)`` for a pipeline with context parallelism, else empty."""
    cp = group_cp(stages)
    return f" (cp {cp})" if cp > 1 else ""


def _tp_of(stages: tuple[StagePlan, ...]) -> str:
    degrees = sorted({s.tp for s in stages}, reverse=True)
    return str(degrees[0]) if len(degrees) == 1 else "{" + ",".join(map(str, degrees)) + "}"


def group_stages(plan: Plan) -> list[tuple[int, int, StagePlan, str]]:
    """``(group, dp, stage, layers label)`` for every pipeline stage of every replica group
    (one group, index 0, when the plan has none)."""
    labels = stage_layers(plan)
    out = [(0, plan.dp, s, labels[s.index]) for s in plan.stages]
    for g in plan.groups[1:]:
        out += [(g.index, g.dp, s, layer_range(s.layer_start, s.layer_end)) for s in g.stages]
    return out


def schedule_summary(plan: Plan) -> str:
    """The schedule, with its virtual stages when interleaved."""
    if chunked_schedule(plan.schedule) and plan.virtual_stages > 1:
        return f"{plan.schedule} (v={plan.virtual_stages})"
    return plan.schedule


def layer_range(start: int, end: int) -> str:
    """Inclusive layer range of ``[start, end)``: ``0–7``, or ``30`` for a single layer."""
    return str(start) if end - start == 1 else f"{start}–{end - 1}"


def stage_layers(plan: Plan) -> list[str]:
    """Per stage, the layers it really holds: its contiguous range, or for an interleaved plan
    its model chunks in chunk-major order (``planning.layers.chunk_layer_ranges``), e.g.
    ``0–1, 4–5``."""
    try:
        chunks = chunk_layer_ranges(plan)
    except ValueError:  # an inconsistent plan: show what it says
        chunks = [[(s.layer_start, s.layer_end)] for s in plan.stages]
    return [", ".join(layer_range(a, b) for a, b in per) for per in chunks]


def stage_table(plan: Plan) -> Table:
    """One row per pipeline stage."""
    table = Table(title=f"Plan for {plan.job}: {plan.model.name}", title_justify="left")
    if plan.groups:
        table.add_column("group", justify="right")
    for name, justify in (
        ("stage", "right"), ("device", "left"), ("vendor", "left"), ("pools", "left"),
        ("DCs", "left"), ("layers", "right"), ("#", "right"), ("TP", "right"),
        ("DP", "right"), ("memory GiB", "right"), ("time ms", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for group, dp, s, label in group_stages(plan):
        extras = "".join(mark for flag, mark in ((s.has_embedding, " +emb"), (s.has_head, " +head"))
                         if flag)
        memory = Text(f"{s.memory_gib:.1f}/{s.capacity_gib:.0f}")
        if s.capacity_gib and s.memory_gib > 0.9 * s.capacity_gib:
            memory.stylize("bold yellow")
        table.add_row(
            *([str(group)] if plan.groups else []),
            str(s.index), s.device, s.vendor, ", ".join(s.pools), ", ".join(s.datacenters),
            f"{label}{extras}", str(s.layers),
            str(s.tp) + (f" cp{s.cp}" if s.cp > 1 else ""),
            str(dp), memory, f"{s.time_ms:.1f}",
        )
    return table


SHARDING_WORDS = {
    "none": "nothing sharded",
    "optimizer": "ZeRO-1: optimizer state",
    "gradients": "ZeRO-2: gradients and optimizer state",
    "full": "ZeRO-3/FSDP: parameters, gradients and optimizer state",
}


def training_summary(plan: Plan) -> str:
    """Precision, activation recompute and what data parallelism shards (over how many)."""
    t = plan.training
    sharding = t.sharding
    group = plan.dp * group_cp(plan.stages)
    over = f" over {group} ranks" if sharding != "none" and group > 1 else ""
    return (f"{t.precision}, recompute {t.recompute}, sharding {sharding} "
            f"({SHARDING_WORDS.get(sharding, sharding)}{over})")


def summary_table(plan: Plan) -> Table:
    """Key/value summary of the whole plan and its predicted performance."""
    p = plan.predicted
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    rows = [
        ("world size", f"{plan.world_size} ranks (one per device) on {len(plan.nodes())} nodes"),
        ("DP×PP×TP", layout_summary(plan)),
        ("microbatch", f"{plan.micro_batch} seq × " + (
            " / ".join(f"{g.num_microbatches} (group {g.index}"
                       + (f"; {g.short_replicas} of {g.dp} replicas: {g.num_microbatches - 1}"
                          if g.short_replicas else "") + ")" for g in plan.groups)
            if plan.groups else f"{plan.num_microbatches}"
            + (f" ({plan.short_replicas} of {plan.dp} replicas: "
               f"{plan.num_microbatches - 1})" if plan.short_replicas else ""))
            + f" per replica (global batch {plan.global_batch})"),
        ("schedule", schedule_summary(plan)),
        ("training", training_summary(plan)),
        ("step time", f"{p.step_time_s:.3f} s"
                      f" (compute {p.compute_s:.3f}, bubble {p.bubble_s:.3f}, "
                      f"TP {p.tp_comm_s:.3f}, PP {p.pp_comm_s:.3f}, DP {p.dp_comm_s:.3f})"),
        ("tokens/s", human_rate(p.tokens_per_s)),
        ("MFU", f"{100 * p.mfu:.1f}%"),
        ("cross-DC / step", human_bytes(p.cross_dc_bytes_per_step)),
        ("pipeline / step", human_bytes(p.pp_bytes_per_step)),
    ]
    if plan.cross_dc:
        settings = ", ".join(f"{k}={v}" for k, v in sorted(plan.cross_dc.items()))
        rows.append(("cross-DC", settings))
    rows.append(("fingerprint", plan.fingerprint()))
    for key, value in rows:
        table.add_row(key, value)
    return table


def notes_text(plan: Plan) -> Text:
    """The planner's notes as a bullet list (empty text when there are none)."""
    text = Text()
    if plan.notes:
        text.append("notes\n", style="bold")
        for note in plan.notes:
            text.append(f" • {note}\n")
    return text


def plan_view(plan: Plan) -> Group:
    """Everything ``hettrain plan`` prints, as one renderable."""
    return Group(stage_table(plan), summary_table(plan), notes_text(plan))


def print_plan(plan: Plan, file: IO[str] | None = None, width: int | None = None) -> None:
    """Print :func:`plan_view` to ``file`` (stdout by default); colour only on a terminal."""
    console = Console(file=file, width=width, soft_wrap=False)
    console.print(plan_view(plan))
