"""``python -m hettrain.runtime``: train this pod's ranks of the plan (one process per rank)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from hettrain.api import constants as C
from hettrain.runtime.checkpoint import (
    CheckpointFormatError,
    CheckpointStorageError,
    write_termination_message,
)
from hettrain.runtime.config import RuntimeConfig
from hettrain.runtime.trainer import run_rank, unsupported


def main() -> int:
    """Run one rank in-process, or spawn ``LOCAL_WORLD_SIZE`` children and wait for them."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        cfg = RuntimeConfig.from_env()
        refused = unsupported(cfg.plan)  # plan options this runtime cannot honour
        if refused:
            raise ValueError(refused[0])
    except ValueError as exc:  # bad env or plan: one line, exit 2, nothing started
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.local_world_size == 1 or os.environ.get(C.ENV_RANK):
        rank = int(os.environ.get(C.ENV_RANK) or cfg.rank_start)
        try:
            run_rank(cfg, rank)
        except (CheckpointStorageError, CheckpointFormatError) as e:
            # bad checkpoint storage or a checkpoint that does not fit the job: one line (no
            # traceback), also in the pod's termination message for the operator
            logging.getLogger("hettrain.runtime").error("rank %d: %s", rank, e)
            write_termination_message(cfg.termination_log, f"HETTRAIN_CHECKPOINT_ERROR: {e}")
            return 2
        return 0
    procs = []
    for i in range(cfg.local_world_size):
        env = dict(os.environ, **{C.ENV_RANK: str(cfg.rank_start + i)})
        procs.append(subprocess.Popen([sys.executable, "-m", "hettrain.runtime"], env=env))
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
