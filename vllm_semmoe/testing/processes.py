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


def fresh_cache_root(path: str | os.PathLike) -> str:
    """A vLLM cache root (``VLLM_CACHE_ROOT``) of its own at ``path``, for an engine whose compile
    caches must start empty, sharing only vLLM's model-info cache (``modelinfos/``, entries keyed
    by the hash of the model's source file) with :func:`~vllm_semmoe.tools.engine.default_cache_root`:
    with no entry for a model class, vLLM inspects it in a child process that imports all of vLLM
    (about 9 CPU-seconds on this machine) at every engine start."""
    from ..tools.engine import default_cache_root

    shared = Path(default_cache_root()) / "modelinfos"
    shared.mkdir(parents=True, exist_ok=True)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    link = root / "modelinfos"
    if not link.exists():
        link.symlink_to(shared, target_is_directory=True)
    return str(root)
