"""pytest fixtures for tests against the real local control plane (``e2e/cluster``).

Enable with ``pytest_plugins = ["e2e.cluster.pytest_plugin"]`` in ``tests/conftest.py``.

Fixtures:
  ``k8s_cluster`` (session)  the cluster: ``.kubeconfig``, ``.api`` (kubernetes ApiClient),
                             ``.kubectl(...)``, ``.restart_apiserver()`` (local only). Started
                             once per session by ``e2e/cluster/up``, stopped at the end unless
                             ``HETTRAIN_KEEP_CLUSTER=1``.
  ``namespace``              a fresh namespace per test (default ServiceAccount present),
                             deleted afterwards.
  ``kwok_nodes``             factory: ``kwok_nodes(cluster_yaml)`` creates Ready fake nodes and
                             deletes them after the test.

Environment:
  ``HETTRAIN_KUBECONFIG``    use this existing cluster; start and stop nothing.
  ``HETTRAIN_KEEP_CLUSTER=1``  leave the cluster running (state in ``HETTRAIN_CLUSTER_DIR``,
                             default ``~/.cache/hettrain/cluster``) so the next session
                             attaches to it in about a second.
  ``HETTRAIN_CLUSTER_DIR``   state dir; default: a fresh temp dir (or the one above when kept).

The binaries are built (once, cached) before the first test runs, during collection, so a
cold build never counts against a test's timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from e2e.cluster import kwoknodes
from kubernetes import client as k8s

CLUSTER_DIR = Path(__file__).resolve().parent
MARKER = "k8s"


@dataclass
class K8sCluster:
    """A running cluster as seen by tests."""

    kubeconfig: Path
    api: k8s.ApiClient
    external: bool = False
    state_dir: Path | None = None
    tools_bin: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        """Run the real kubectl against this cluster; returns stdout."""
        exe = str(self.tools_bin / "kubectl") if self.tools_bin else "kubectl"
        proc = subprocess.run(
            [exe, "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            check=False,
        )
        if check and proc.returncode:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def api_ready(self) -> bool:
        """Whether the apiserver answers ``/readyz`` with ok (admin client certificate)."""
        if self.state_dir is None:
            raise RuntimeError("api_ready needs the local cluster (state dir)")
        pki = self.state_dir / "pki"
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        try:
            with urllib.request.urlopen(f"{self.env['HETTRAIN_API_URL']}/readyz", timeout=2,
                                        context=ctx) as resp:
                return resp.status == 200 and resp.read().strip() == b"ok"
        except OSError:
            return False

    def restart_apiserver(self, timeout: float = 120.0) -> float:
        """Crash the local kube-apiserver (SIGKILL) and start it again with the same command
        line, port and certificates; etcd keeps every object. Returns the seconds until
        ``/readyz`` answered ok again. Only for the local cluster (``e2e/cluster/up``)."""
        if self.external or self.state_dir is None:
            raise RuntimeError("restart_apiserver needs the local cluster, not HETTRAIN_KUBECONFIG")
        t0 = time.monotonic()
        restart_component(self.state_dir, "kube-apiserver")
        wait_for(self.api_ready, timeout, 0.2, "kube-apiserver /readyz after its restart")
        return time.monotonic() - t0


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def _wants_cluster(items: list[pytest.Item]) -> bool:
    return any(
        item.get_closest_marker(MARKER) or "k8s_cluster" in getattr(item, "fixturenames", ())
        for item in items
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``k8s`` marker (harmless if pyproject already does)."""
    config.addinivalue_line("markers", f"{MARKER}: needs the real local control plane")


@pytest.hookimpl(trylast=True)  # after -m/-k deselection, so `-m "not k8s"` builds nothing
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Build the control plane binaries up front if any selected test needs the cluster."""
    if os.environ.get("HETTRAIN_KUBECONFIG") or not _wants_cluster(items):
        return
    if config.option.collectonly:
        return
    capman = config.pluginmanager.getplugin("capturemanager")
    t0 = time.monotonic()
    with capman.global_and_fixture_disabled() if capman else _null():
        proc = subprocess.run([str(CLUSTER_DIR / "build")], stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise pytest.UsageError(
            f"e2e/cluster/build failed (exit {proc.returncode}) after "
            f"{time.monotonic() - t0:.0f}s; see its output above"
        )


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _start_local(state_dir: Path) -> tuple[Path, dict[str, str]]:
    env = {**os.environ, "HETTRAIN_CLUSTER_DIR": str(state_dir)}
    proc = subprocess.run(
        [str(CLUSTER_DIR / "up")], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise RuntimeError(
            f"e2e/cluster/up failed (exit {proc.returncode}); logs in {state_dir}/logs\n"
            f"{proc.stderr[-4000:]}"
        )
    kubeconfig = Path(proc.stdout.strip().splitlines()[-1])
    info: dict[str, str] = {}
    for line in (state_dir / "cluster.env").read_text().splitlines():
        key, _, value = line.partition("=")
        info[key] = value
    return kubeconfig, info


@pytest.fixture(scope="session")
def k8s_cluster() -> Iterator[K8sCluster]:
    """The session's cluster: an external one (HETTRAIN_KUBECONFIG) or a local one."""
    external = os.environ.get("HETTRAIN_KUBECONFIG")
    if external:
        api = kwoknodes.api_client(external)
        yield K8sCluster(Path(external), api, external=True)
        api.close()
        return
    keep = _truthy("HETTRAIN_KEEP_CLUSTER")
    tmp_parent: Path | None = None
    if os.environ.get("HETTRAIN_CLUSTER_DIR"):
        state_dir = Path(os.environ["HETTRAIN_CLUSTER_DIR"])
    elif keep:
        state_dir = Path.home() / ".cache" / "hettrain" / "cluster"
    else:
        # A private parent dir, so up's sibling lock file goes away with it.
        tmp_parent = Path(tempfile.mkdtemp(prefix="hettrain-cluster-"))
        state_dir = tmp_parent / "cluster"
    try:
        kubeconfig, info = _start_local(state_dir)
    except RuntimeError as exc:
        subprocess.run(
            [str(CLUSTER_DIR / "down"), "--keep-state"],
            env={**os.environ, "HETTRAIN_CLUSTER_DIR": str(state_dir)},
            check=False,
        )
        pytest.fail(str(exc), pytrace=False)
    api = kwoknodes.api_client(kubeconfig)
    tools = info.get("HETTRAIN_TOOLS_BIN")
    cluster = K8sCluster(
        kubeconfig, api, state_dir=state_dir, tools_bin=Path(tools) if tools else None, env=info
    )
    try:
        yield cluster
    finally:
        api.close()
        if not keep:
            subprocess.run(
                [str(CLUSTER_DIR / "down")],
                env={**os.environ, "HETTRAIN_CLUSTER_DIR": str(state_dir)},
                check=False,
                capture_output=True,
            )
            if tmp_parent:
                shutil.rmtree(tmp_parent, ignore_errors=True)


_restarted: dict[int, subprocess.Popen[bytes]] = {}  # components this process started


def restart_component(state_dir: Path, name: str, sig: int = signal.SIGKILL,
                      timeout: float = 30.0) -> int:
    """Stop one component of the local control plane (``$STATE/pids/NAME``) with ``sig``
    and start it again exactly as ``up`` did: the same argv and working directory (read
    from /proc before the kill), its own session, output appended to ``logs/NAME.log``.
    Updates the pid file (``down`` keeps working) and returns the new pid; waiting for the
    component to be ready is the caller's business."""
    pid_file = state_dir / "pids" / name
    pid = int(pid_file.read_text().strip())
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    cwd = os.readlink(f"/proc/{pid}/cwd")
    os.kill(pid, sig)
    own = _restarted.pop(pid, None)  # started by an earlier restart: our child, reap it
    if own is not None:
        own.wait(timeout)
    deadline = time.monotonic() + timeout
    # A multi-threaded process's leader shows Z while its other threads still exit and hold
    # its sockets: wait until it is reaped (or a zombie alone), then until its port is free.
    port = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--secure-port=")), None)
    while not _exited(pid) or (port is not None and not _port_free(port)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} (pid {pid}) still alive {timeout:.0f}s after signal {sig}")
        time.sleep(0.05)
    with (state_dir / "logs" / f"{name}.log").open("ab") as log:
        log.write(f"\n===== restarted at {time.strftime('%H:%M:%S')} =====\n".encode())
        log.flush()
        proc = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    _restarted[proc.pid] = proc
    pid_file.write_text(f"{proc.pid}\n")
    return proc.pid


def _exited(pid: int) -> bool:
    """Whether every thread of process ``pid`` has exited (reaped, or a lone zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z" and threads <= 1


def _port_free(port: int) -> bool:
    """Whether 127.0.0.1:``port`` can be listened on again."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _dns_label(text: str, limit: int) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-") or "t"


def exists(read: Callable[..., Any], *args: Any) -> bool:
    """Whether a ``read_*`` call finds its object (404 → False; other API errors propagate)."""
    try:
        read(*args)
    except k8s.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 60.0,
    interval: float = 0.25,
    what: str = "condition",
) -> Any:
    """Poll ``predicate`` until it returns something truthy; return that or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@pytest.fixture
def namespace(k8s_cluster: K8sCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A unique namespace for this test, with its ``default`` ServiceAccount; deleted after."""
    name = f"t-{_dns_label(request.node.name, 40)}-{uuid.uuid4().hex[:6]}"
    core = k8s.CoreV1Api(k8s_cluster.api)
    core.create_namespace(
        k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name, labels={"hettrain.dev/test": "true"}))
    )

    wait_for(lambda: exists(core.read_namespaced_service_account, "default", name), 30,
             what=f"ServiceAccount {name}/default")
    try:
        yield name
    finally:
        try:
            core.delete_namespace(name, propagation_policy="Background")
        except k8s.ApiException as exc:
            if exc.status != 404:
                raise


@pytest.fixture
def kwok_nodes(
    k8s_cluster: K8sCluster,
) -> Iterator[Callable[..., list[str]]]:
    """Factory: ``kwok_nodes(cluster_yaml, ready=True)`` -> node names; deleted after the test."""
    created: list[str] = []

    def make(
        cluster: str | Path | Mapping[str, Any], ready: bool = True, timeout: float = 120.0
    ) -> list[str]:
        names = kwoknodes.create_nodes(k8s_cluster.api, cluster)
        created.extend(names)
        if ready:
            kwoknodes.wait_nodes(k8s_cluster.api, names, timeout=timeout)
        return names

    yield make
    if created:
        kwoknodes.delete_nodes(k8s_cluster.api, created)
