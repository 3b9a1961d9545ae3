"""A real Prometheus server (Debian `prometheus`) scraping real hettrain exporters."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """HTTP API client of one running server."""

    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: str) -> dict:
        """GET /api/v1/<path>; returns the decoded JSON (errors are returned, not raised)."""
        q = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as exc:
            return json.load(exc)

    def query(self, expr: str) -> dict:
        """Instant query."""
        return self.api("query", query=expr)

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict:
        """Range query."""
        return self.api("query_range", query=expr, start=str(start), end=str(end), step=str(step))


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.25)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


@contextmanager
def running_stack(tmp: Path) -> Iterator[Prometheus]:
    """Exporters (operator + 2 runtime ranks) and a Prometheus scraping them every second."""
    prom_bin = shutil.which("prometheus")
    if not prom_bin:
        raise RuntimeError("prometheus missing: run tools/install-lint-tools (Debian package)")
    ports = {"operator": free_port(), "rank0": free_port(), "rank1": free_port()}
    procs: list[subprocess.Popen] = []
    env_py = [sys.executable, str(HERE / "exporters.py")]
    try:
        for name, port in ports.items():
            args = ["operator", str(port)] if name == "operator" else [
                "runtime", str(port), name[-1]]
            procs.append(subprocess.Popen([*env_py, *args], stdout=subprocess.PIPE, text=True,
                                          cwd=ROOT, env=_pyenv()))
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                # hettrain metrics carry their own `job` label (the training job's name).
                {"job_name": "hettrain-operator", "honor_labels": True,
                 "static_configs": [{"targets": [f"127.0.0.1:{ports['operator']}"]}]},
                {"job_name": "hettrain-runtime", "honor_labels": True,
                 "static_configs": [{"targets": [f"127.0.0.1:{ports['rank0']}",
                                                 f"127.0.0.1:{ports['rank1']}"]}]},
            ],
            "rule_files": [str(ROOT / "monitoring" / "alerts.yaml")],
        }
        cfg = tmp / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        web = free_port()
        log = (tmp / "prometheus.log").open("w")
        procs.append(subprocess.Popen(
            [prom_bin, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{web}"], stdout=log, stderr=subprocess.STDOUT))
        prom = Prometheus(f"http://127.0.0.1:{web}")

        def ready() -> bool:
            try:
                targets = prom.api("targets")["data"]["activeTargets"]
            except OSError:
                return False
            return len(targets) == 3 and all(t["health"] == "up" for t in targets)

        _wait(ready, 60, "prometheus targets up")
        # rate()/increase() need >= 2 samples per series
        _wait(lambda: prom.query("rate(hettrain_runtime_collective_seconds_total[1m])")["data"][
            "result"], 30, "two scrapes")
        yield prom
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _pyenv() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": f"{ROOT / 'operator'}:{os.environ.get('PYTHONPATH', '')}"}
