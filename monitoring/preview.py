"""Static HTML preview of the Grafana dashboard, plotted from a real Prometheus.

``python monitoring/preview.py --prometheus http://127.0.0.1:9090 --out preview.html``
lays the panels out by their gridPos (24 columns) and draws each target's query_range
result as inline SVG (timeseries) or as the latest value (stat/table). Stdlib only.
"""

from __future__ import annotations

import argparse
import html
import json
import time
import urllib.parse
import urllib.request
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent / "dashboards" / "hettrain.json"
COLS, ROW_PX, WIDTH_PX = 24, 30, 1380
COLORS = ("#73bf69", "#f2cc0c", "#5794f2", "#ff7383", "#b877d9", "#ff9830", "#8ab8ff")


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    """Series of one range query (raises RuntimeError on a Prometheus error)."""
    q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{q}", timeout=15) as r:
        body = json.load(r)
    if body["status"] != "success":
        raise RuntimeError(f"{expr}: {body.get('error')}")
    return body["data"]["result"]


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Apply a Grafana legendFormat like '{{job}} {{tier}}'."""
    out = fmt
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    return out


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"


def svg_lines(series: list[tuple[str, list[tuple[float, float]]]], w: int, h: int) -> str:
    """An SVG line chart of (name, [(t, v)]) with min/max axis labels."""
    pts = [p for _, s in series for p in s]
    if not pts:
        return f'<svg width="{w}" height="{h}"><text x="10" y="20" fill="#888">No data</text></svg>'
    t0, t1 = min(p[0] for p in pts), max(p[0] for p in pts)
    v0, v1 = min(0.0, min(p[1] for p in pts)), max(p[1] for p in pts)
    v1 = v1 if v1 > v0 else v0 + 1
    pad_l, pad_b = 48, 16

    def xy(t: float, v: float) -> str:
        x = pad_l + (t - t0) / ((t1 - t0) or 1) * (w - pad_l - 4)
        y = 4 + (1 - (v - v0) / (v1 - v0)) * (h - pad_b - 8)
        return f"{x:.1f},{y:.1f}"

    parts = [f'<svg width="{w}" height="{h}" xmlns="http://www.w3.org/2000/svg">',
             f'<text x="2" y="12" class="ax">{_fmt(v1)}</text>',
             f'<text x="2" y="{h - pad_b}" class="ax">{_fmt(v0)}</text>',
             f'<line x1="{pad_l}" y1="{h - pad_b - 4}" x2="{w}" y2="{h - pad_b - 4}" '
             'class="grid"/>']
    for i, (name, s) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        poly = " ".join(xy(t, v) for t, v in s)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{poly}"/>')
        parts.append(f'<text x="{pad_l + 6 + 150 * (i % 4)}" y="{h - 2}" fill="{color}" '
                     f'class="lg">{html.escape(name[:28])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render(dashboard: dict, url: str, minutes: float = 5.0) -> str:
    """The dashboard as one HTML page with every panel plotted from ``url``."""
    end = time.time()
    start, step = end - 60 * minutes, max(1.0, 60 * minutes / 200)
    col = WIDTH_PX / COLS
    boxes = []
    for p in dashboard["panels"]:
        g = p["gridPos"]
        w, h = int(g["w"] * col) - 8, g["h"] * ROW_PX - 8
        series = []
        for t in p["targets"]:
            expr = t["expr"].replace("$job", ".*")
            for s in query_range(url, expr, start, end, step):
                vals = [(float(a), float(b)) for a, b in s["values"] if b not in ("NaN", "+Inf")]
                series.append((legend(t.get("legendFormat", ""), s["metric"]) or expr, vals))
        if p["type"] == "timeseries":
            body = svg_lines(series, w - 12, h - 34)
        else:
            body = "".join(f'<div class="stat"><b>{_fmt(v[-1][1]) if v else "-"}</b> '
                           f'{html.escape(n)}</div>' for n, v in series) or "No data"
        boxes.append(
            f'<div class="panel" style="left:{g["x"] * col:.0f}px;top:{g["y"] * ROW_PX}px;'
            f'width:{w}px;height:{h}px"><div class="title">{html.escape(p["title"])}</div>'
            f'{body}</div>')
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"]) * ROW_PX
    return f"""<!doctype html><html><head><meta charset="utf-8">
<title>{html.escape(dashboard["title"])}</title><style>
body{{background:#111217;color:#ccccdc;font:12px sans-serif;margin:10px}}
h1{{font-size:16px;margin:0 0 8px}} .board{{position:relative;height:{height}px}}
.panel{{position:absolute;background:#181b1f;border:1px solid #2c3235;border-radius:3px;
padding:4px 6px;box-sizing:border-box;overflow:hidden}}
.title{{font-weight:600;margin-bottom:4px}} .ax{{fill:#8e8e8e;font-size:10px}}
.lg{{font-size:10px}} .grid{{stroke:#2c3235}} .stat{{font-size:12px;margin:2px 0}}
.stat b{{font-size:18px;color:#73bf69}}</style></head><body>
<h1>{html.escape(dashboard["title"])} — preview from {html.escape(url)}</h1>
<div class="board">{"".join(boxes)}</div></body></html>
"""


def main(argv: list[str] | None = None) -> int:
    """CLI: write the preview HTML."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    ap.add_argument("--dashboard", type=Path, default=DASHBOARD)
    ap.add_argument("--minutes", type=float, default=5.0, help="time range to plot")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.write_text(render(json.loads(a.dashboard.read_text()), a.prometheus, a.minutes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
