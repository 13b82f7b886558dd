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
    return run_sessions([cmd], env, [log], timeout, cwd)[0]


def run_sessions(cmds: list[list[str]], env: dict[str, str], logs: list[str | os.PathLike], timeout: float,
                 cwd: str | os.PathLike | None = None, grace: float = 60.0) -> list[int | None]:
    """Run the commands together, each in a new session logging to its ``logs`` entry (e.g. the
    ranks of one job under vLLM's external launcher); their exit statuses, ``None`` for one still
    running ``timeout`` seconds after the start, or ``grace`` seconds after another failed (a
    rank waiting for a dead peer would wait out its collectives' timeout). Every process of every
    session is killed afterwards."""
    import time

    procs, sinks = [], [open(log, "w") for log in logs]
    try:
        for cmd, sink in zip(cmds, sinks):
            procs.append(subprocess.Popen(cmd, env=env, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(proc.poll() is None for proc in procs):
            if any(proc.returncode for proc in procs):
                deadline = min(deadline, time.monotonic() + grace)
            time.sleep(0.2)
        return [proc.poll() for proc in procs]
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        for sink in sinks:
            sink.close()


def log_tail(path: str | os.PathLike, lines: int = 60) -> str:
    """The last ``lines`` lines of a log (or a note that there is none)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"<no log at {path}>"


def fresh_cache_root(path: str | os.PathLike) -> str:
    """A vLLM cache root (``VLLM_CACHE_ROOT``) of its own at ``path``, for an engine whose compile
    caches must start empty (the test suite still shares Inductor's content-keyed cache, see
    ``tests/startup/sitecustomize.py``), sharing only vLLM's model-info cache (``modelinfos/``,
    entries keyed by the hash of the model's source file) with
    :func:`~vllm_semmoe.tools.engine.default_cache_root`:
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
