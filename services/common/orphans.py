"""Child processes that must not outlive their parent. A parent killed by a signal cannot stop its
children, and a child blocked in a collective or a user function never reads the EOF of its pipe:
it would hold its GPU and memory (an NCCL wait also spins the GPU at 100%) until a timeout. The
child watches its parent instead. Standard library only: the reward sandbox's worker imports this
before its memory limit, and nothing else of RoleFleet."""

from __future__ import annotations

import logging
import os
import threading
import time

PERIOD_S = 1.0


def exit_with_parent(code: int, what: str) -> None:
    """From now on, exit with `code` within about a second of the parent process ending (its pid
    is no longer this process's parent: an orphan is adopted by init or a subreaper). Call it first
    thing in the child; `what` names the child in the log line."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PERIOD_S)
        logging.getLogger(__name__).error("%s: its parent process %d is gone; exiting", what, parent)
        os._exit(code)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
