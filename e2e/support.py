"""The operator as a local process authenticated as the Helm chart's ServiceAccount.

The chart is installed with its RBAC; the operator's Deployment is kept Pending (a nodeSelector
no node has) and the same code runs here instead, with a kubeconfig holding a TokenRequest
token of the chart's ServiceAccount, so every API call is authorised by the chart's RBAC.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "hettrain-operator"
PENDING_SELECTOR = "hettrain\\.dev/e2e-no-such-node"


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sa_kubeconfig(admin_kubeconfig: Path, kubectl: str, namespace: str, sa: str,
                  out: Path, duration: str = "2h") -> Path:
    """A kubeconfig for ``sa`` (token from the TokenRequest API: ``kubectl create token``),
    with the server and CA of the admin kubeconfig's current context."""
    base = [kubectl, "--kubeconfig", str(admin_kubeconfig)]
    token = subprocess.run([*base, "create", "token", sa, "-n", namespace,
                            f"--duration={duration}"], capture_output=True, text=True,
                           check=True, timeout=60).stdout.strip()
    view = json.loads(subprocess.run([*base, "config", "view", "--raw", "--minify",
                                      "--flatten", "-o", "json"], capture_output=True,
                                     text=True, check=True, timeout=60).stdout)
    cluster = view["clusters"][0]["cluster"]
    doc = {"apiVersion": "v1", "kind": "Config",
           "clusters": [{"name": "e2e", "cluster": cluster}],
           "users": [{"name": sa, "user": {"token": token}}],
           "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": sa,
                                                    "namespace": namespace}}],
           "current-context": "e2e"}
    out.write_text(yaml.safe_dump(doc))
    out.chmod(0o600)
    return out


@dataclass
class OperatorProcess:
    """A running ``kopf run -m hettrain.handlers`` child with its log and metrics port."""

    proc: subprocess.Popen
    log: Path
    metrics_port: int

    @classmethod
    def start(cls, kubeconfig: Path, log: Path, timeout: float = 90,
              topology: Path | None = None) -> OperatorProcess:
        """Start it and wait until its /metrics answers (it serves them after login).
        ``topology``: a cluster YAML whose links/devices the planner uses
        (``HETTRAIN_CLUSTER_CONFIG``; Node objects carry no inter-DC links)."""
        port, live = free_port(), free_port()
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HETTRAIN_METRICS_PORT": str(port),
               "HETTRAIN_METRICS_ADDR": "127.0.0.1",
               **({"HETTRAIN_CLUSTER_CONFIG": str(topology)} if topology else {}),
               "PYTHONPATH": str(ROOT / "operator") + os.pathsep + os.environ.get(
                   "PYTHONPATH", "")}
        with open(log, "w") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kopf", "run", "-m", "hettrain.handlers",
                 "--all-namespaces", "--standalone", f"--liveness=http://127.0.0.1:{live}/healthz"],
                env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        op = cls(proc, log, port)
        deadline = time.monotonic() + timeout
        while op.metrics() is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                op.stop()
                raise RuntimeError(f"operator did not come up; log {log}:\n{op.tail()}")
            time.sleep(0.3)
        return op

    def metrics(self) -> str | None:
        """The /metrics text, or None."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=2) as r:
                return r.read().decode()
        except OSError:
            return None

    def tail(self, n: int = 6000) -> str:
        """The end of the operator's log."""
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self) -> None:
        """TERM its process group, KILL after 10 s."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def forbidden_lines(self) -> list[str]:
        """Log lines reporting 403s: RBAC denied the operator something."""
        return [ln for ln in self.tail(10**7).splitlines()
                if "403" in ln and ("Forbidden" in ln or "forbidden" in ln)]


def wait_schedulable(api: Any, names: list[str], timeout: float = 120) -> float:
    """Wait until every node is Ready *and* untainted (the node lifecycle controller lifts the
    ``not-ready`` taint a few seconds after kwok reports Ready); returns the seconds waited.
    The planner skips tainted nodes, so planning before this sees a partial cluster."""
    from kubernetes import client as k8s

    core = k8s.CoreV1Api(api)
    want = set(names)
    t0 = time.monotonic()
    while True:
        nodes = core.list_node(label_selector="type=kwok").items
        ok = {n.metadata.name for n in nodes if not n.spec.taints and any(
            cond.type == "Ready" and cond.status == "True"
            for cond in n.status.conditions or ())}
        if want <= ok:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{len(want - ok)} of {len(want)} nodes not Ready+untainted "
                               f"after {timeout:.0f}s, e.g. {sorted(want - ok)[:3]}")
        time.sleep(0.5)
