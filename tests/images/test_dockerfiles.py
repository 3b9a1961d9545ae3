"""Container images: hadolint, non-root multi-stage builds, and the entrypoints they run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "images").glob("*/Dockerfile"))
IDS = [p.parent.name for p in DOCKERFILES]


def test_both_images_exist() -> None:
    assert IDS == ["operator", "runtime"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=IDS)
def test_hadolint_clean(hadolint: Path, dockerfile: Path) -> None:
    res = subprocess.run([str(hadolint), "--failure-threshold", "info", str(dockerfile)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=IDS)
def test_multi_stage_pinned_and_non_root(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    stages = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert len(stages) >= 2, "multi-stage build expected"
    for arg in re.findall(r"^ARG\s+(?:BASE|PYTHON_IMAGE)=(\S+)", text, re.M):
        assert ":" in arg and not arg.endswith(":latest"), f"base image not pinned: {arg}"
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0"), "final stage must be non-root"
    assert users[-1].split(":")[0] == "10001", "uid must match the chart's runAsUser"


def test_runtime_variants_documented() -> None:
    doc = (ROOT / "docs" / "images.md").read_text()
    for base in re.findall(r"^#\s+(?:CUDA|ROCm|CPU)[^:]*:\s+(\S+)",
                           (ROOT / "images" / "runtime" / "Dockerfile").read_text(), re.M):
        assert base in doc, f"docs/images.md does not list the base {base}"


def test_operator_entrypoint_imports_the_handlers() -> None:
    """The image runs `kopf run -m hettrain.handlers`: the module imports and kopf has `run`."""
    kopf = ROOT / ".venv" / "bin" / "kopf"
    res = subprocess.run([str(kopf), "run", "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--liveness" in res.stdout
    code = ("import hettrain.handlers, kopf; r = kopf.get_default_registry(); "
            "print(sum(len(list(x.get_all_handlers())) for x in (r._changing, r._spawning)))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "operator")})
    assert res.returncode == 0, res.stderr
    assert int(res.stdout.strip().splitlines()[-1]) > 0, "hettrain.handlers registered nothing"


def test_runtime_entrypoint_names_the_missing_env() -> None:
    """`python -m hettrain.runtime` with no plan fails fast, naming the variable to set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETTRAIN_")}
    env["PYTHONPATH"] = str(ROOT / "operator")
    res = subprocess.run([sys.executable, "-m", "hettrain.runtime"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env=env)
    assert res.returncode != 0
    assert "HETTRAIN_PLAN_PATH" in res.stderr
