"""Throughput over time per policy, with failure marks (SVG or PNG).

One panel per policy (first seed): the job's running tokens/s averaged over 600 equal time bins
(checkpoint pauses, outages and degraded plans show as dips; work later rolled back is not
subtracted) as a step line over simulated days, and a mark at every interruption coloured by
cause. matplotlib is imported only inside
:func:`render_throughput` (the simulator stays importable without it), and drawn on an Agg
canvas with the object API as :mod:`hettrain.render.figure` does.
"""

from __future__ import annotations

from pathlib import Path

from hettrain.sim.run import SimReport

CAUSE_COLORS = {"node": "#d62728", "rack": "#9467bd", "dc": "#8c564b", "software": "#ff7f0e"}
BINS = 600


def binned(trace: list[tuple[float, float]], horizon_s: float, bins: int = BINS
           ) -> tuple[list[float], list[float]]:
    """Mean of a step function ``[(t, value), ...]`` over ``bins`` equal bins of [0, horizon].

    Returns (bin start times, bin means). The step holds each value until the next point.
    """
    width = horizon_s / bins
    sums = [0.0] * bins
    for (t0, v), (t1, _) in zip(trace, [*trace[1:], (horizon_s, 0.0)], strict=True):
        a, b = max(t0, 0.0), min(t1, horizon_s)
        while a < b and v:
            k = min(int(a // width), bins - 1)
            end = min(b, (k + 1) * width)
            sums[k] += v * (end - a)
            a = end if end > a else b
    return [k * width for k in range(bins)], [x / width for x in sums]


def render_throughput(report: SimReport, path: str | Path, fmt: str = "png") -> None:
    """Draw ``report``'s first-seed throughput of every policy to ``path`` (svg or png)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if fmt not in ("svg", "png"):
        raise ValueError(f"fmt must be svg or png, got {fmt!r}")
    pols = report.policies
    fig = Figure(figsize=(11, 2.3 * len(pols) + 0.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(pols), 1, sharex=True, squeeze=False)[:, 0]
    full = report.full_tokens_per_s / 1e6
    for ax, pol in zip(axes, pols, strict=True):
        r = report.results[pol][0]
        starts, means = binned(r.trace, r.wall_s)
        ax.step([t / 86400 for t in starts], [v / 1e6 for v in means], where="post",
                color="#4c78a8", linewidth=0.8, gid=f"throughput-{pol}")
        ax.axhline(full, color="#888888", linewidth=0.6, linestyle="--")
        seen: set[str] = set()
        for t, cause in r.marks:
            label = cause if cause not in seen else None
            seen.add(cause)
            ax.plot([t / 86400], [full * 1.04], marker="v", markersize=3, linestyle="none",
                    color=CAUSE_COLORS.get(cause, "#333333"), label=label)
        ax.set_ylim(0, full * 1.12)
        ax.set_ylabel("M tokens/s")
        ax.set_title(f"{pol}: ETTR {r.ettr:.3f}, goodput {r.goodput_ratio:.3f}, "
                     f"{r.total_interruptions} interruptions, {r.replans} re-plans",
                     fontsize=9, loc="left")
        if seen:
            ax.legend(loc="lower right", fontsize=7, ncols=len(seen), title="interruption",
                      title_fontsize=7)
    axes[-1].set_xlabel("simulated days")
    fig.suptitle(f"{report.scenario}: {report.gpus} GPUs, seed {report.seeds[0]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path), format=fmt, dpi=110)
