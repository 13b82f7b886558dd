"""Running a helper process for a test: in its own session, logged, bounded in time."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def run_logged(cmd: list[str], env: dict[str, str], log: str | os.PathLike, timeout: float,
               cwd: str | os.PathLike | None = None) -> int | None:
    """Run ``cmd`` in a new session with stdout and stderr to ``log``; its exit status, or
    ``None`` when it ran past ``timeout`` seconds. Every process of the session is killed
    afterwards (a worker that outlived its parent included)."""
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    return rc


def log_tail(path: str | os.PathLike, lines: int = 60) -> str:
    """The last ``lines`` lines of a log (or a note that there is none)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"<no log at {path}>"
