"""An emulated slow link between two network namespaces: rate AND delay, without ``sch_netem``.

Where the kernel has ``sch_netem`` one would write ``tc qdisc add dev veth root netem rate 1gbit
delay 5ms``. This host's kernel has no netem (and no ``sch_fq``, so no EDT/BPF delay either), so
the link is a userspace delay line instead: two TUN devices, ``hxtun-a`` in namespace A
(10.250.0.1) and ``hxtun-b`` in namespace B (10.250.0.2), point-to-point, with one process
(:func:`run_delay_line`) reading every IP packet the kernel sends out of one TUN and writing it
into the other after

    departure = max(arrival, previous departure) + bytes * 8 / rate     (serialisation)
    delivery  = departure + delay                                       (propagation)

i.e. a FIFO link of the given rate and one-way delay (netem's ``rate`` + ``delay``), with a
tail-drop queue of ``limit`` bytes waiting for serialisation (default 1.5 MB: netem's default
1000 packets of a 1500-byte MTU). Both directions are independent; TCP runs with the
namespaces' default congestion control (bbr on this host).
The TUN MTU is large (64000) so 1 Gbit/s is ~2k packets/s, which a single Python thread
forwards with sub-millisecond timing error; :func:`probe` measures what the link really does
(TCP round trip, bulk throughput) so a benchmark can print the numbers next to its results.

The devices' ``tx_bytes`` counters count what crossed the link, exactly like a veth's.

Usage (root): ``python bench/slowlink.py up --rate-gbit 1 --delay-ms 5`` then
``ip netns exec hxbench-a ...``; ``python bench/slowlink.py probe``; ``python bench/slowlink.py
down``. :class:`SlowLink` is the same as a context manager for scripts.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

NS = ("hxbench-a", "hxbench-b")
DEV = ("hxtun-a", "hxtun-b")
ADDR = ("10.250.0.1", "10.250.0.2")
MTU = 64000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
PIDFILE = Path("/run/hettrain-slowlink.pid")


# ----------------------------------------------------------------------------- delay line

def open_tun(name: str) -> int:
    """Create (or attach to) TUN device ``name`` in the current namespace; returns its fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class Direction:
    """One direction of the link: a FIFO of (delivery time, packet) with rate and delay."""

    def __init__(self, rate_bps: float, delay_s: float, limit: int) -> None:
        self.rate_bps, self.delay_s, self.limit = rate_bps, delay_s, limit
        self.queue: deque[tuple[float, bytes]] = deque()
        self.last_departure = 0.0
        self.dropped = 0

    def push(self, packet: bytes, now: float) -> None:
        """Queue a packet that arrived at ``now``; tail drop when more than ``limit`` bytes
        are still waiting to be serialised."""
        if self.rate_bps > 0 and (self.last_departure - now) * self.rate_bps / 8 > self.limit:
            self.dropped += 1
            return
        departure = max(now, self.last_departure) + (len(packet) * 8 / self.rate_bps
                                                     if self.rate_bps > 0 else 0.0)
        self.last_departure = departure
        self.queue.append((departure + self.delay_s, packet))

    def due(self, now: float) -> list[bytes]:
        """Pop every packet whose delivery time has come."""
        out = []
        while self.queue and self.queue[0][0] <= now:
            out.append(self.queue.popleft()[1])
        return out

    def next_due(self) -> float | None:
        """Delivery time of the head packet, or None when empty."""
        return self.queue[0][0] if self.queue else None


def run_delay_line(fds: tuple[int, int], rate_bps: float, delay_s: float,
                   limit: int = 1_500_000,
                   stop: list[bool] | None = None) -> None:
    """Forward packets between the two TUN fds forever (until ``stop[0]`` or a signal)."""
    dirs = {fds[0]: (Direction(rate_bps, delay_s, limit), fds[1]),
            fds[1]: (Direction(rate_bps, delay_s, limit), fds[0])}
    for fd in fds:
        os.set_blocking(fd, False)
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    while not (stop and stop[0]):
        now = time.monotonic()
        heads = [t for d, _ in dirs.values() if (t := d.next_due()) is not None]
        timeout_ms = max(0.0, (min(heads) - now) * 1e3) if heads else 200.0
        for fd, _ in poller.poll(timeout_ms):
            direction = dirs[fd][0]
            now = time.monotonic()
            while True:
                try:
                    packet = os.read(fd, MTU + 64)
                except BlockingIOError:
                    break
                direction.push(packet, now)
        now = time.monotonic()
        for direction, out_fd in dirs.values():
            for packet in direction.due(now):
                try:
                    os.write(out_fd, packet)
                except (BlockingIOError, OSError):
                    direction.dropped += 1


# ----------------------------------------------------------------------------- namespaces

def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _configure() -> None:
    """Namespaces exist, TUNs created in the root namespace: move and address them."""
    for ns, dev, addr, peer in zip(NS, DEV, ADDR, reversed(ADDR), strict=True):
        _sh("ip", "link", "set", dev, "netns", ns)
        _sh("ip", "-n", ns, "link", "set", dev, "mtu", str(MTU))
        _sh("ip", "-n", ns, "addr", "add", addr, "peer", f"{peer}/32", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")


def up(rate_gbit: float, delay_ms: float, limit: int = 1_500_000) -> int:
    """Create both namespaces and start the delay line (a daemon child); returns its pid."""
    down()
    for ns in NS:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the delay line: create the TUNs here so this process holds their fds
        os.close(ready_r)
        try:
            os.setsid()
            fds = (open_tun(DEV[0]), open_tun(DEV[1]))
            os.write(ready_w, b"1")
            os.close(ready_w)
            stop = [False]
            signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
            run_delay_line(fds, rate_gbit * 1e9, delay_ms / 1e3, limit, stop)
        finally:
            os._exit(0)
    os.close(ready_w)
    ok = os.read(ready_r, 1)
    os.close(ready_r)
    if ok != b"1":
        raise RuntimeError("slow link: the delay line could not create its TUN devices")
    PIDFILE.write_text(str(pid))
    try:
        _configure()
    except subprocess.CalledProcessError:
        down()
        raise
    return pid


def down() -> None:
    """Stop the delay line and delete the namespaces (idempotent)."""
    if PIDFILE.exists():
        try:
            pid = int(PIDFILE.read_text())
            os.kill(pid, signal.SIGTERM)
            for _ in range(50):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
                time.sleep(0.02)
        except (ValueError, ProcessLookupError, ChildProcessError):
            pass
        PIDFILE.unlink(missing_ok=True)
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class SlowLink:
    """``with SlowLink(1, 5) as link:`` -- namespaces up for the block, down after."""

    def __init__(self, rate_gbit: float, delay_ms: float, limit: int = 1_500_000) -> None:
        self.rate_gbit, self.delay_ms, self.limit = rate_gbit, delay_ms, limit

    def describe(self) -> str:
        """The link in netem's words."""
        return (f"TUN delay line, rate {self.rate_gbit:g}gbit delay {self.delay_ms:g}ms "
                f"limit {self.limit / 1e6:g}MB")

    def __enter__(self) -> SlowLink:
        up(self.rate_gbit, self.delay_ms, self.limit)
        return self

    def __exit__(self, *exc: object) -> None:
        down()


# ----------------------------------------------------------------------------- probe

def _probe_server(port: int, bulk: int) -> None:
    with socket.create_server((ADDR[1], port)) as srv:
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while (b := conn.recv(1)) == b"p":  # ping-pong
                conn.sendall(b"p")
            got = len(b)
            while got < bulk:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                got += len(chunk)
            conn.sendall(b"d")


def _probe_client(port: int, pings: int, bulk: int) -> dict:
    with socket.create_connection((ADDR[1], port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            s.sendall(b"p")
            s.recv(1)
            rtts.append(time.perf_counter() - t0)
        payload = b"x" * (1 << 20)
        t0 = time.perf_counter()
        sent = 0
        while sent < bulk:
            s.sendall(payload)
            sent += len(payload)
        s.recv(1)
        dt = time.perf_counter() - t0
    rtts.sort()
    return {"rtt_ms_median": 1e3 * rtts[len(rtts) // 2], "rtt_ms_min": 1e3 * rtts[0],
            "throughput_gbit": sent * 8 / dt / 1e9}


def probe(pings: int = 20, bulk_mib: int = 64, port: int = 39123) -> dict:
    """TCP round trip (median of ``pings``) and bulk throughput A->B across the live link."""
    bulk = bulk_mib << 20
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import slowlink; slowlink._probe_server({port}, {bulk})")
    srv = subprocess.Popen(["ip", "netns", "exec", NS[1], sys.executable, "-c", code])
    try:
        cli = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
               f"import slowlink; print(json.dumps(slowlink._probe_client({port}, {pings}, "
               f"{bulk})))")
        for _ in range(100):  # until the server listens
            r = subprocess.run(["ip", "netns", "exec", NS[0], sys.executable, "-c", cli],
                               capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                return json.loads(r.stdout)
            time.sleep(0.05)
        raise RuntimeError(f"slow link probe failed: {r.stderr[-500:]}")
    finally:
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()


def main() -> None:
    """``up`` / ``probe`` / ``down`` from the command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("up", "probe", "down"))
    ap.add_argument("--rate-gbit", type=float, default=1.0)
    ap.add_argument("--delay-ms", type=float, default=5.0)
    ap.add_argument("--limit", type=int, default=1_500_000, help="queue limit in bytes")
    args = ap.parse_args()
    if args.action == "up":
        pid = up(args.rate_gbit, args.delay_ms, args.limit)
        print(f"slow link up: {NS[0]} {ADDR[0]} <-> {NS[1]} {ADDR[1]}, rate "
              f"{args.rate_gbit:g}gbit delay {args.delay_ms:g}ms (delay line pid {pid})")
    elif args.action == "probe":
        print(probe())
    else:
        down()


if __name__ == "__main__":
    main()
