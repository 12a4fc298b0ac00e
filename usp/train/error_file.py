"""A failing rank's one-line error, left where torchrun's launcher looks for it; and a
finished rank's line, for the case where it dies after its work was done.

torchrun gives every worker a file (``TORCHELASTIC_ERROR_FILE``) for the error that ended
it; its failure table shows what is there. ``usp train`` writes its own error line into
it (in torchelastic's JSON layout, with usp's exit status and a precise time added), so
torchrun's table shows usp's message instead of "To enable traceback see ...", and the
launcher form ``usp train CONFIG --nproc-per-node N`` (:mod:`usp.cli.launch`) prints the
first failing rank's line last. A rank whose run finished writes a line with status
:data:`FINISHED` before it tears down: if it then dies at exit (torchrun reads the file of
a failed rank only), the launcher says the run finished and which rank died instead of
reporting a failed run. Outside torchrun nothing is written.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

ENV = "TORCHELASTIC_ERROR_FILE"
#: the status of a finished rank's record (``usp train``'s exit status when it is done)
FINISHED = 0
_KEY = "usp"  # usp's own block next to torchelastic's "message"


def write_error_file(message: str, status: int) -> None:
    """Record ``message`` and the exit status for the launcher, as one line (the line
    breaks of a multi-line message become spaces: the launcher prints it last); best
    effort (a file that cannot be written must not hide the error itself)."""
    path = os.environ.get(ENV)
    if not path:
        return
    message = " ".join(message.split("\n"))
    now = time.time()
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": message, "timestamp": str(int(now))},
        },
        _KEY: {"message": message, "status": status, "time": now},
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


@dataclass(frozen=True)
class RecordedError:
    message: str
    status: int
    time: float

    @property
    def finished(self) -> bool:
        """The rank finished its run before it wrote this (not an error)."""
        return self.status == FINISHED


def read_error_data(data: Any) -> RecordedError | None:
    """What :func:`write_error_file` wrote, from the file's parsed JSON (None: not usp's)."""
    block = data.get(_KEY) if isinstance(data, dict) else None
    if not isinstance(block, dict):
        return None
    try:
        return RecordedError(str(block["message"]), int(block["status"]), float(block["time"]))
    except (KeyError, TypeError, ValueError):
        return None
