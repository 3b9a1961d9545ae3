"""The failure/repair timeline of one seed: sampled from a failure model or read from a trace.

The timeline is policy-independent (common random numbers): nodes fail and come back whatever
the job does, so it is generated once per seed and replayed for every policy. Each event carries
a uniform draw ``u`` that the engine uses for the policy-dependent question "did this hit a node
the current plan uses?" — so the same draw decides it for every policy.

Sampling: for every failure kind the superposition of the per-node (per-rack, per-DC, per-GPU)
exponential processes is one Poisson process; its events are drawn with exponential gaps and a
uniform target. A hit on a node that is already down is dropped (thinning), which gives exactly
"every *up* node fails at its rate" for memoryless failures.

Trace files (``--trace``), CSV with a header or JSONL, one event per row/line::

    time_s,target,kind,duration_s,slowdown
    3600,node:h100-sxm-dc0-007,fail,14400,
    7200,rack:h100-sxm-dc0/3,fail,3600,
    9000,dc:dc0,fail,1800,
    9500,job,software,0,
    12000,node:h100-sxm-dc0-001,straggle,1800,1.5

``kind`` is ``fail`` (node/rack/dc down for ``duration_s``), ``software`` (target ``job``: a
job-level crash, no node lost) or ``straggle`` (a node runs ``slowdown``× slower for
``duration_s``). Racks are ``<pool>/<k>`` with ``k`` counted from 0 in steps of
``nodesPerRack`` nodes. A trace event hits the job deterministically: node failures and
stragglers always hit a node in use when the plan uses every node of that pool; with spare
nodes the engine decides with the event's ``u`` (derived from the row number and the seed).
"""

from __future__ import annotations

import csv
import heapq
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from hettrain.sim.cluster import Topology
from hettrain.sim.model import HOUR, MAX_EXPECTED_EVENTS, Duration, FailureModel, SimInputError

DOWN, UP, SOFTWARE, SLOW_START, SLOW_END = "down", "up", "software", "slow_start", "slow_end"
CAUSES = ("node", "rack", "dc", "software", "straggler")
# a trace file's bytes: MAX_EXPECTED_EVENTS rows of ~100 bytes with room to spare
MAX_TRACE_BYTES = 256 << 20
_MAX_DIGITS = 4300  # CPython's default int <-> str digit limit (sys.get_int_max_str_digits)


@dataclass(frozen=True, slots=True)
class Event:
    """One change of the cluster. ``counts``: (pool index, nodes) that go down/up/slow."""

    time_s: float
    kind: str
    cause: str
    counts: tuple[tuple[int, int], ...] = ()
    until_s: float = math.inf  # DOWN: when these nodes are back; SLOW_START: end of slowdown
    u: float = 0.0
    slowdown: float = 1.0
    ref: int = -1  # links SLOW_START to its SLOW_END


@dataclass(frozen=True, slots=True)
class Timeline:
    """All events of one seed, in time order, over ``horizon_s``."""

    events: tuple[Event, ...]
    horizon_s: float
    seed: int

    def count(self, kind: str, cause: str | None = None) -> int:
        """Number of events of a kind (and cause)."""
        return sum(1 for e in self.events if e.kind == kind and cause in (None, e.cause))


def sample_duration(rng: random.Random, d: Duration) -> float:
    """One draw of ``d`` (seconds)."""
    if d.dist == "fixed":
        return d.mean_s
    if d.dist == "exponential":
        return rng.expovariate(1.0 / d.mean_s)
    return rng.lognormvariate(d.lognormal_mu(), d.sigma)


def _poisson_times(rng: random.Random, rate_per_s: float, horizon_s: float) -> list[float]:
    """Arrival times of a Poisson process on [0, horizon)."""
    out: list[float] = []
    if rate_per_s <= 0:
        return out
    t = rng.expovariate(rate_per_s)
    while t < horizon_s:
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


# candidate = (time, order, cause, node indices, duration, slowdown)
_Candidate = tuple[float, int, str, tuple[int, ...], float, float]


def _candidates(topo: Topology, model: FailureModel, horizon_s: float,
                rng: random.Random) -> list[_Candidate]:
    out: list[_Candidate] = []
    npr = topo.nodes_per_rack
    for p in range(topo.pools):
        n, off = topo.pool_nodes[p], topo.node_offset(p)
        rate = model.node_rate_per_s(topo.pool_device[p], topo.pool_gpus_per_node[p])
        for t in _poisson_times(rng, rate * n, horizon_s):
            node = off + rng.randrange(n)
            out.append((t, len(out), "node", (node,), sample_duration(rng, model.repair), 1.0))
        if model.rack_mtbf_h > 0:
            racks = topo.racks(p)
            for t in _poisson_times(rng, racks / (model.rack_mtbf_h * HOUR), horizon_s):
                r = rng.randrange(racks)
                nodes = tuple(range(off + r * npr, off + min(n, (r + 1) * npr)))
                out.append((t, len(out), "rack", nodes, sample_duration(rng, model.repair), 1.0))
        if model.straggler_gpu_mtbf_h > 0:
            srate = n * topo.pool_gpus_per_node[p] / (model.straggler_gpu_mtbf_h * HOUR)
            for t in _poisson_times(rng, srate, horizon_s):
                node = off + rng.randrange(n)
                out.append((t, len(out), "straggler", (node,),
                            sample_duration(rng, model.straggler_duration),
                            model.straggler_slowdown))
    if model.dc_mtbf_h > 0:
        for dc in sorted(set(topo.pool_dc)):
            nodes = tuple(i for p in range(topo.pools) if topo.pool_dc[p] == dc
                          for i in range(topo.node_offset(p), topo.node_offset(p)
                                         + topo.pool_nodes[p]))
            for t in _poisson_times(rng, 1.0 / (model.dc_mtbf_h * HOUR), horizon_s):
                out.append((t, len(out), "dc", nodes, sample_duration(rng, model.dc_duration),
                            1.0))
    if model.software_gpu_mtbf_h > 0:
        for t in _poisson_times(rng, topo.gpus / (model.software_gpu_mtbf_h * HOUR), horizon_s):
            out.append((t, len(out), "software", (), 0.0, 1.0))
    return out


def _pool_of(topo: Topology) -> list[int]:
    return [p for p in range(topo.pools) for _ in range(topo.pool_nodes[p])]


def resolve(topo: Topology, candidates: list[_Candidate], horizon_s: float, seed: int,
            rng: random.Random) -> Timeline:
    """Turn candidate failures into DOWN/UP (and other) events, dropping hits on down nodes."""
    pool_of = _pool_of(topo)
    down_until = [0.0] * topo.nodes
    events: list[Event] = []
    ups: list[tuple[float, int, tuple[tuple[int, int], ...]]] = []
    for t, order, cause, nodes, duration, slowdown in sorted(candidates):
        while ups and ups[0][0] <= t:
            ut, _, counts = heapq.heappop(ups)
            events.append(Event(ut, UP, "repair", counts))
        u = rng.random()
        if cause == "software":
            events.append(Event(t, SOFTWARE, cause, (), t, u))
            continue
        if cause == "straggler":
            node = nodes[0]
            if down_until[node] > t:
                continue
            counts = ((pool_of[node], 1),)
            end = t + duration
            events.append(Event(t, SLOW_START, cause, counts, end, u, slowdown, order))
            events.append(Event(end, SLOW_END, cause, counts, end, u, slowdown, order))
            continue
        hit = [i for i in nodes if down_until[i] <= t]
        if not hit:
            continue
        end = t + duration
        per_pool: dict[int, int] = {}
        for i in hit:
            down_until[i] = end
            per_pool[pool_of[i]] = per_pool.get(pool_of[i], 0) + 1
        counts = tuple(sorted(per_pool.items()))
        events.append(Event(t, DOWN, cause, counts, end, u))
        heapq.heappush(ups, (end, order, counts))
    while ups:
        ut, _, counts = heapq.heappop(ups)
        events.append(Event(ut, UP, "repair", counts))
    kept = [e for e in events if e.time_s < horizon_s]
    kept.sort(key=lambda e: (e.time_s, _KIND_ORDER[e.kind]))
    return Timeline(tuple(kept), horizon_s, seed)


_KIND_ORDER = {UP: 0, SLOW_END: 1, DOWN: 2, SOFTWARE: 3, SLOW_START: 4}


def _expected_events(topo: Topology, model: FailureModel, horizon_s: float
                     ) -> list[tuple[str, float, float]]:
    """(field, MTBF hours, unit-hours over the horizon) of every sampled kind that is on: the
    kind's expected number of sampled events is unit-hours / MTBF."""
    hours = horizon_s / HOUR
    out: list[tuple[str, float, float]] = []
    gpus: dict[str, float] = {}
    for p in range(topo.pools):
        dev = topo.pool_device[p]
        gpus[dev] = gpus.get(dev, 0.0) + topo.pool_nodes[p] * topo.pool_gpus_per_node[p]
    default_gpus = sum(g for dev, g in gpus.items() if dev not in model.device_mtbf_h)
    w = model.where
    out.append((f"{w}.gpuMtbfHours", model.gpu_mtbf_h, default_gpus * hours))
    out.extend((f"{w}.devices.{dev}.gpuMtbfHours", mtbf, gpus[dev] * hours)
               for dev, mtbf in model.device_mtbf_h.items() if dev in gpus)
    out.append((f"{w}.rack.mtbfHours", model.rack_mtbf_h,
                sum(topo.racks(p) for p in range(topo.pools)) * hours))
    out.append((f"{w}.datacenter.mtbfHours", model.dc_mtbf_h, len(set(topo.pool_dc)) * hours))
    out.append((f"{w}.stragglers.gpuMtbfHours", model.straggler_gpu_mtbf_h, topo.gpus * hours))
    out.append((f"{w}.softwareGpuMtbfHours", model.software_gpu_mtbf_h, topo.gpus * hours))
    return [(f, m, u) for f, m, u in out if m > 0 and u > 0]


def check_event_budget(topo: Topology, model: FailureModel, horizon_s: float) -> None:
    """Refuse a model whose expected sampled events over ``horizon_s`` exceed
    :data:`~hettrain.sim.model.MAX_EXPECTED_EVENTS` (a tiny MTBF would sample without end);
    the error names the field with the most events and the MTBF that fits the budget."""
    kinds = _expected_events(topo, model, horizon_s)
    total = sum(u / m for _, m, u in kinds)
    if total <= MAX_EXPECTED_EVENTS:
        return
    name, mtbf, units = max(kinds, key=lambda k: k[2] / k[1])
    raise SimInputError(name, f"{mtbf:g} h gives about {units / mtbf:.3g} sampled events over "
                              f"{horizon_s / 86400:g} days on {topo.gpus} GPUs ({total:.3g} "
                              f"of all kinds; at most {MAX_EXPECTED_EVENTS:,} per seed are "
                              f"simulated); raise it to at least "
                              f"{units / MAX_EXPECTED_EVENTS * 1.001:.3g} or shorten --days")


def sample_timeline(topo: Topology, model: FailureModel, horizon_s: float, seed: int
                    ) -> Timeline:
    """The sampled timeline of one seed (deterministic in ``seed``); a model with too many
    expected events raises :class:`SimInputError` (:func:`check_event_budget`)."""
    if horizon_s <= 0:
        raise SimInputError("--days", f"must be > 0 (got {horizon_s / 86400:g})")
    check_event_budget(topo, model, horizon_s)
    rng = random.Random(seed)
    return resolve(topo, _candidates(topo, model, horizon_s, rng), horizon_s, seed, rng)


# ---------------------------------------------------------------- traces


def _read_trace(path: Path) -> str:
    """The trace's text, at most :data:`MAX_TRACE_BYTES` (read in one bounded read: a pipe or
    a huge file is refused, not read whole)."""
    with path.open("rb") as f:
        data = f.read(MAX_TRACE_BYTES + 1)
    if len(data) > MAX_TRACE_BYTES:
        raise SimInputError(str(path), f"is larger than {MAX_TRACE_BYTES >> 20} MiB (a trace "
                                       f"holds at most {MAX_EXPECTED_EVENTS:,} events per "
                                       "seed); cut it to the simulated --days")
    return data.decode("utf-8")


def _check_rows(path: Path, count: int) -> None:
    if count > MAX_EXPECTED_EVENTS:
        raise SimInputError(str(path), f"has more than {MAX_EXPECTED_EVENTS:,} events (at most "
                                       "that many per seed are simulated); cut it to the "
                                       "simulated --days")


def _rows(path: Path) -> list[tuple[str, dict[str, str]]]:
    try:
        text = _read_trace(path)
    except UnicodeDecodeError as exc:
        raise SimInputError(str(path), f"is not UTF-8 text (offset {exc.start}); save the "
                                       "trace as UTF-8") from None
    except OSError as exc:
        raise SimInputError(str(path), f"cannot read the trace: {exc.strerror or exc}") from None
    rows: list[tuple[str, dict[str, str]]] = []
    if path.suffix in (".jsonl", ".ndjson"):
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SimInputError(f"{path}:{n}", f"invalid JSON: {exc.msg}") from None
            except RecursionError:
                raise SimInputError(f"{path}:{n}", "JSON nested too deeply; one flat object "
                                                   "per line") from None
            except ValueError:  # an integer past Python's int-string digit limit
                raise SimInputError(f"{path}:{n}", "a number has too many digits (at most "
                                                   f"{_MAX_DIGITS}); write times and durations "
                                                   "as plain seconds") from None
            if not isinstance(obj, dict):
                raise SimInputError(f"{path}:{n}", "each line must be a JSON object")
            rows.append((f"{path}:{n}", {k: "" if v is None else str(v) for k, v in obj.items()}))
            _check_rows(path, len(rows))
        return rows
    reader = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    try:
        for n, row in enumerate(reader, start=2):
            rows.append((f"{path}:{n}", {k.strip(): (v or "").strip()
                                          for k, v in row.items() if k}))
            _check_rows(path, len(rows))
    except csv.Error as exc:  # e.g. a field over the csv module's field size limit
        raise SimInputError(f"{path}:{reader.reader.line_num}",
                            f"unreadable CSV row ({exc}); fix or shorten the row") from None
    return rows


def _num(row: dict[str, str], key: str, where: str, default: float | None = None) -> float:
    raw = row.get(key, "")
    if raw == "" and default is not None:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise SimInputError(f"{where}.{key}", f"must be a number (got {raw!r})") from None
    if not math.isfinite(v) or v < 0:
        raise SimInputError(f"{where}.{key}", f"must be a finite number >= 0 (got {raw!r})")
    return v


def _target_nodes(topo: Topology, target: str, where: str) -> tuple[str, tuple[int, ...]]:
    scope, _, name = target.partition(":")
    if scope == "node":
        return "node", (topo.node_index(name, f"{where}.target"),)
    if scope == "rack":
        pool, _, k = name.rpartition("/")
        p = topo.pool_index(pool, f"{where}.target")
        if not k.isdigit() or int(k) >= topo.racks(p):
            raise SimInputError(f"{where}.target", f"rack {name!r}: index must be 0.."
                                                   f"{topo.racks(p) - 1}")
        off, npr = topo.node_offset(p), topo.nodes_per_rack
        end = min(topo.pool_nodes[p], (int(k) + 1) * npr)
        return "rack", tuple(range(off + int(k) * npr, off + end))
    if scope == "dc":
        nodes = tuple(i for p in range(topo.pools) if topo.pool_dc[p] == name
                      for i in range(topo.node_offset(p), topo.node_offset(p)
                                     + topo.pool_nodes[p]))
        if not nodes:
            raise SimInputError(f"{where}.target", f"datacenter {name!r} has no pools "
                                                   f"({', '.join(sorted(set(topo.pool_dc)))})")
        return "dc", nodes
    raise SimInputError(f"{where}.target", f"{target!r} must be node:NAME, rack:POOL/K, "
                                           "dc:NAME or job")


def load_trace(path: str | Path, topo: Topology, horizon_s: float, seed: int = 0) -> Timeline:
    """Read a CSV/JSONL trace into a :class:`Timeline` (events past ``horizon_s`` dropped)."""
    p = Path(path)
    rng = random.Random(seed)
    candidates: list[_Candidate] = []
    for where, row in _rows(p):
        t = _num(row, "time_s", where)
        kind = row.get("kind", "")
        target = row.get("target", "")
        duration = _num(row, "duration_s", where, 0.0)
        if kind == "software":
            if target not in ("", "job"):
                raise SimInputError(f"{where}.target", "a software event's target must be job")
            candidates.append((t, len(candidates), "software", (), 0.0, 1.0))
        elif kind == "fail":
            cause, nodes = _target_nodes(topo, target, where)
            if duration <= 0:
                raise SimInputError(f"{where}.duration_s", "a failure needs duration_s > 0 "
                                                           "(time until the nodes are back)")
            candidates.append((t, len(candidates), cause, nodes, duration, 1.0))
        elif kind == "straggle":
            cause, nodes = _target_nodes(topo, target, where)
            if cause != "node":
                raise SimInputError(f"{where}.target", "a straggler targets one node:NAME")
            slowdown = _num(row, "slowdown", where, 1.5)
            if slowdown < 1:
                raise SimInputError(f"{where}.slowdown", f"must be >= 1 (got {slowdown})")
            candidates.append((t, len(candidates), "straggler", nodes, duration, slowdown))
        else:
            raise SimInputError(f"{where}.kind", f"must be fail, software or straggle "
                                                 f"(got {kind!r})")
    return resolve(topo, candidates, horizon_s, seed, rng)
