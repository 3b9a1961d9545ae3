"""The hettrain operator as a real subprocess (``kopf run -m hettrain.handlers``) for tests and
benchmarks: its log goes to a file, never to the test output; every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "hettrainingjobs.hettrain.dev.yaml"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; connection errors raise OSError."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.read().decode()


class OperatorProcess:
    """One operator process against ``kubeconfig``, restartable (also by SIGKILL)."""

    def __init__(self, kubeconfig: Path | str, log_path: Path | str,
                 env: Mapping[str, str] | None = None,
                 mode: Sequence[str] = ("--standalone",)) -> None:
        self.kubeconfig = str(kubeconfig)
        self.mode = list(mode)  # --standalone, or --peering=NAME --priority=N
        self.log_path = Path(log_path)
        self.extra_env = dict(env or {})
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def metrics_url(self) -> str:
        """The operator's Prometheus endpoint."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def health_url(self) -> str:
        """kopf's liveness endpoint (JSON of the probes)."""
        return f"http://127.0.0.1:{self.health_port}/healthz"

    def start(self, env: Mapping[str, str] | None = None, timeout: float = 60.0) -> None:
        """Start the operator and wait until its liveness and metrics endpoints answer."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("operator already running")
        full_env = {**os.environ, "KUBECONFIG": self.kubeconfig,
                    "HETTRAIN_METRICS_PORT": str(self.metrics_port),
                    "HETTRAIN_METRICS_ADDR": "127.0.0.1",
                    "PYTHONPATH": f"{ROOT / 'operator'}{os.pathsep}{ROOT}",
                    **self.extra_env, **(env or {})}
        self.starts += 1
        log = self.log_path.open("ab")
        log.write(f"\n===== start #{self.starts} at {time.strftime('%H:%M:%S')} =====\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kopf", "run", "-m", "hettrain.handlers",
             "--all-namespaces", *self.mode,
             f"--liveness=http://127.0.0.1:{self.health_port}/healthz"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
            cwd=str(ROOT), start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if http_get(self.health_url, 2)[0] == 200 and http_get(self.metrics_url, 2)[0]:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"operator not healthy after {timeout:.0f}s:\n{self.tail()}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL (no graceful shutdown, as a crashed or OOM-killed operator)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self, env: Mapping[str, str] | None = None) -> None:
        """Stop gracefully and start again (optionally with extra env for this run)."""
        self.stop()
        self.start(env)

    def health(self) -> dict[str, object]:
        """The liveness endpoint's JSON."""
        status, body = http_get(self.health_url)
        if status != 200:
            raise RuntimeError(f"liveness answered {status}")
        return dict(json.loads(body))

    def tail(self, lines: int = 40) -> str:
        """The last lines of the operator log (for failure messages)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no operator log)"
        return "\n".join(text.splitlines()[-lines:])
