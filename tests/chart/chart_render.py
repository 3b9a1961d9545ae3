"""Render the chart with the real helm and split the output into documents."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "hettrain-operator"


def helm_template(helm: Path, *args: str, release: str = "rel", namespace: str = "hettrain"
                  ) -> subprocess.CompletedProcess[str]:
    """Run ``helm template`` on the chart; returns the completed process (not checked)."""
    cmd = [str(helm), "template", release, str(CHART), "--namespace", namespace, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def render(helm: Path, *args: str, **kw: str) -> list[dict]:
    """Rendered objects (``helm template`` must succeed)."""
    out = helm_template(helm, *args, **kw)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    """Objects of one kind."""
    return [o for o in objs if o["kind"] == kind]
