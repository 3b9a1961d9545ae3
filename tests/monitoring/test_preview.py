"""The dashboard preview: rendered from real Prometheus data and screenshotted by chromium."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dashboard import load
from promserver import ROOT, Prometheus

sys.path.insert(0, str(ROOT / "monitoring"))
import preview

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1400,1000"]


def screenshot(html_path: Path, png: Path, profile: Path) -> subprocess.CompletedProcess[str]:
    """Headless Debian chromium screenshot of a local HTML file."""
    exe = shutil.which("chromium")
    assert exe, "chromium missing: apt-get install -y chromium"
    return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                           f"--screenshot={png}", html_path.as_uri()],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_preview_plots_every_panel_from_prometheus(prometheus: Prometheus,
                                                   tmp_path: Path) -> None:
    d = load()
    page = preview.render(d, prometheus.url, minutes=1)
    assert page.count('class="panel"') == len(d["panels"])
    assert "No data" not in page
    n_lines = sum(len(t["targets"]) for t in d["panels"] if t["type"] == "timeseries")
    assert page.count("<polyline") >= n_lines
    html_path = tmp_path / "preview.html"
    html_path.write_text(page)
    png = tmp_path / "dashboard.png"
    res = screenshot(html_path, png, tmp_path / "profile")
    assert res.returncode == 0, res.stderr[-2000:]
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(head[16:20], "big") == 1400  # IHDR width
