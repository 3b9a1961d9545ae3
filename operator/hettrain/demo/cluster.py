"""The demo's Kubernetes side: local control plane, CRD, kwok nodes, the operator, job status."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from hettrain.api import constants as c

CRD_FILE = "crds/hettrainingjobs.hettrain.dev.yaml"


class DemoError(RuntimeError):
    """A demo step failed; the message says what and where to look."""


def repo_root(explicit: str | None = None) -> Path:
    """The hettrain checkout (it holds ``e2e/cluster/up``): ``--repo``, $HETTRAIN_REPO or
    the source tree this package was installed from (editable install)."""
    candidates = [explicit, os.environ.get("HETTRAIN_REPO"), str(Path(__file__).resolve()
                                                                 .parents[3])]
    for cand in candidates:
        if cand and (Path(cand) / "e2e" / "cluster" / "up").is_file():
            return Path(cand).resolve()
    raise DemoError("cannot find the hettrain checkout (e2e/cluster/up); run the demo from an "
                    "editable install or pass --repo PATH (or set HETTRAIN_REPO)")


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.25, alive: Callable[[], None] | None = None) -> Any:
    """Poll until ``predicate()`` is truthy (returned); ``alive()`` may raise to abort early."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise DemoError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@dataclass
class LocalCluster:
    """A control plane started by ``e2e/cluster/up`` in ``state_dir``."""

    repo: Path
    state_dir: Path
    kubeconfig: Path
    tools_bin: Path | None

    @classmethod
    def start(cls, repo: Path, state_dir: Path, log: Path) -> LocalCluster:
        """Run ``up`` (which builds the binaries first if needed); its log goes to ``log``."""
        env = {**os.environ, "HETTRAIN_CLUSTER_DIR": str(state_dir)}
        with open(log, "w") as err:
            proc = subprocess.run([str(repo / "e2e" / "cluster" / "up")], env=env,
                                  stdout=subprocess.PIPE, stderr=err, text=True, check=False)
        if proc.returncode:
            raise DemoError(f"e2e/cluster/up failed (exit {proc.returncode}); see {log} and "
                            f"{state_dir}/logs")
        kubeconfig = Path(proc.stdout.strip().splitlines()[-1])
        info = dict(line.partition("=")[::2] for line in
                    (state_dir / "cluster.env").read_text().splitlines() if "=" in line)
        tools = info.get("HETTRAIN_TOOLS_BIN")
        return cls(repo, state_dir, kubeconfig, Path(tools) if tools else None)

    def stop(self) -> None:
        """``e2e/cluster/down``: kill every component, remove the state dir."""
        env = {**os.environ, "HETTRAIN_CLUSTER_DIR": str(self.state_dir)}
        subprocess.run([str(self.repo / "e2e" / "cluster" / "down")], env=env,
                       capture_output=True, check=False, timeout=60)


def kubectl(kubeconfig: Path, tools_bin: Path | None, *args: str,
            stdin: str | None = None) -> str:
    """Run kubectl; raise DemoError with its stderr on failure."""
    exe = str(tools_bin / "kubectl") if tools_bin else "kubectl"
    proc = subprocess.run([exe, "--kubeconfig", str(kubeconfig), *args], input=stdin,
                          capture_output=True, text=True, check=False, timeout=120)
    if proc.returncode:
        raise DemoError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def api_client(kubeconfig: Path) -> k8s.ApiClient:
    """A kubernetes ApiClient for ``kubeconfig``."""
    cfg = k8s.Configuration()
    k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    cfg.connection_pool_maxsize = 16
    return k8s.ApiClient(cfg)


def operator_command(liveness_port: int) -> list[str]:
    """``kopf run -m hettrain.handlers --all-namespaces --standalone`` with this interpreter."""
    return [sys.executable, "-m", "kopf", "run", "-m", "hettrain.handlers", "--all-namespaces",
            "--standalone",
            f"--liveness=http://127.0.0.1:{liveness_port}/healthz"]


def start_operator(kubeconfig: Path, metrics_port: int, liveness_port: int, log: Path,
                   extra_env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """The operator as a child process in its own process group; stdout+stderr → ``log``."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig),
           "HETTRAIN_METRICS_PORT": str(metrics_port), **(extra_env or {})}
    with open(log, "w") as out:
        return subprocess.Popen(operator_command(liveness_port), env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def http_get(url: str, timeout: float = 2.0) -> str | None:
    """Body of a GET, or None if it fails."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode()
    except OSError:
        return None


def metric_lines(text: str | None, prefix: str) -> list[str]:
    """Sample lines of a Prometheus exposition whose name starts with ``prefix``, without
    ``_created``/``_bucket`` series and without zero-valued per-phase gauges."""
    out = []
    for ln in (text or "").splitlines():
        name = ln.split("{")[0].split(" ")[0]
        if not ln.startswith(prefix) or name.endswith(("_created", "_bucket")):
            continue
        if 'phase="' in ln and ln.rsplit(" ", 1)[-1] in ("0", "0.0"):
            continue
        out.append(ln)
    return out


def ensure_namespace(api: k8s.ApiClient, name: str, timeout: float = 60) -> None:
    """Create the namespace (if missing) and wait for its default ServiceAccount."""
    core = k8s.CoreV1Api(api)
    try:
        core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name)))
    except k8s.ApiException as exc:
        if exc.status != 409:
            raise

    def has_sa() -> bool:
        try:
            core.read_namespaced_service_account("default", name)
            return True
        except k8s.ApiException as exc:
            if exc.status == 404:
                return False
            raise

    wait_for(has_sa, timeout, f"ServiceAccount {name}/default")


def untainted(api: k8s.ApiClient, names: list[str]) -> bool:
    """Whether every named node exists with no taints."""
    nodes = {n.metadata.name: n for n in k8s.CoreV1Api(api).list_node().items}
    return all(n in nodes and not nodes[n].spec.taints for n in names)


def get_job(api: k8s.ApiClient, ns: str, name: str) -> dict[str, Any]:
    """The HetTrainingJob as a dict."""
    return k8s.CustomObjectsApi(api).get_namespaced_custom_object(c.GROUP, c.VERSION, ns,
                                                                  c.PLURAL, name)


def condition(job: Mapping[str, Any], ctype: str) -> dict[str, Any] | None:
    """``status.conditions[type=ctype]`` or None."""
    for cond in (job.get("status") or {}).get("conditions") or ():
        if cond.get("type") == ctype:
            return dict(cond)
    return None


def is_true(job: Mapping[str, Any], ctype: str) -> bool:
    """Whether the condition is True."""
    cond = condition(job, ctype)
    return bool(cond and cond.get("status") == "True")


def plan_json(api: k8s.ApiClient, ns: str, job: Mapping[str, Any]) -> str:
    """plan.json of the job's current plan ConfigMap (``status.plan.configMap``)."""
    cm = ((job.get("status") or {}).get("plan") or {}).get("configMap")
    if not cm:
        raise DemoError(f"job {ns}/{job['metadata']['name']} has no status.plan.configMap")
    data = k8s.CoreV1Api(api).read_namespaced_config_map(cm, ns).data or {}
    if c.PLAN_CONFIGMAP_KEY not in data:
        raise DemoError(f"ConfigMap {ns}/{cm} has no {c.PLAN_CONFIGMAP_KEY}")
    return str(data[c.PLAN_CONFIGMAP_KEY])


def job_pods(api: k8s.ApiClient, ns: str, job: str) -> list[Any]:
    """The job's pods (label ``hettrain.dev/job``)."""
    return k8s.CoreV1Api(api).list_namespaced_pod(
        ns, label_selector=f"{c.LABEL_JOB}={job}").items


def job_events(api: k8s.ApiClient, ns: str, job: str) -> list[Any]:
    """Events on the job, oldest first."""
    items = k8s.CoreV1Api(api).list_namespaced_event(
        ns, field_selector=f"involvedObject.name={job},involvedObject.kind={c.KIND}").items
    return sorted(items, key=lambda e: str(e.last_timestamp or e.event_time or ""))


def load_job_manifest(path: Path, steps: int | None, interval: int | None, *,
                      data_uri: str | None = None,
                      checkpoint_endpoint: str | None = None) -> dict[str, Any]:
    """The demo job manifest with the demo's steps, checkpoint interval, token set
    (``spec.data.uri``) and S3 endpoint (``spec.checkpoint.endpoint``) patched in."""
    doc = yaml.safe_load(path.read_text())
    spec = doc.setdefault("spec", {})
    if steps is not None:
        spec.setdefault("training", {})["steps"] = steps
    ckpt = spec.setdefault("checkpoint", {})
    if checkpoint_endpoint is not None:
        ckpt["endpoint"] = checkpoint_endpoint
    if interval is not None:
        ckpt["intervalSteps"] = interval
    if data_uri is not None:
        spec["data"] = {"uri": data_uri}
    return doc
