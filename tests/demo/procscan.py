"""Find the processes a run started, by a marker in their environment (children inherit it)."""

from __future__ import annotations

import os
from pathlib import Path

MARKER = "HETTRAIN_DEMO_TEST_ID"


def marked_pids(token: str) -> dict[int, str]:
    """{pid: command line} of live processes whose environment has ``MARKER=token``."""
    needle = f"{MARKER}={token}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            stat = (entry / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":  # zombie: already dead
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        found[int(entry.name)] = cmd.strip()
    return found
