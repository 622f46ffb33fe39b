"""What the Ray workers of this test session wrote to their logs (Ray keeps each worker's
stderr under the session's logs folder)."""

from __future__ import annotations

import glob
import os
import time


def worker_log_mentions(text: str, timeout_s: float = 10.0, pid: int | None = None) -> bool:
    """Whether a worker's stderr log (``pid``'s only, when given) shows ``text`` within
    ``timeout_s``."""
    import ray

    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    pattern = f"worker-*-{pid}.err" if pid is not None else "worker-*"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in glob.glob(os.path.join(logs, pattern)):
            with open(path, errors="replace") as fh:
                if text in fh.read():
                    return True
        time.sleep(0.25)
    return False
