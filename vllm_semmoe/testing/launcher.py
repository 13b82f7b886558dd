"""Engines under vLLM's external launcher (``distributed_executor_backend="external_launcher"``,
how ``torchrun`` runs offline tensor parallelism): every TP rank is a process of its own that
builds the same engines in step, so one set of rank processes serves many engines, where the
``mp`` executor starts worker processes for each."""

from __future__ import annotations

import os


def become_launched_rank(rank: int, world_size: int) -> None:
    """Make this process TP rank ``rank`` of ``world_size``: the environment torchrun gives
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``; set ``MASTER_PORT`` per engine
    with :func:`next_engine`), engines in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as
    the launcher requires).

    The ranks meet at ``tcp://MASTER_ADDR:MASTER_PORT`` rather than vLLM's ``env://``: vLLM's CPU
    worker names its shared-memory groups after the last field of the rendezvous address, which
    is ``//`` for every ``env://`` job, so two launched jobs on one machine (or one after a
    killed one) would open the same segments (``create shm in SHMManager failed. errno: 17``)."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      VLLM_ENABLE_V1_MULTIPROCESSING="0")

    def distributed_args(self) -> tuple[str, int, int]:
        return (f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", int(os.environ["RANK"]),
                int(os.environ["LOCAL_RANK"]))

    ExecutorWithExternalLauncher._distributed_args = distributed_args


def rendezvous_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1, free now and below the kernel's range of
    ephemeral ports (``net.ipv4.ip_local_port_range``), one per engine the ranks will start.

    The ranks meet at these ports minutes after they are chosen. A port from the ephemeral
    range (what binding port 0 gives) can meanwhile be handed to any outgoing connection (gloo
    opens many), and rank 0 then fails to listen (``EADDRINUSE``) while its peers wait for it;
    below that range only an explicit bind takes a port."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    candidates = list(range(10000, ephemeral_low))
    random.SystemRandom().shuffle(candidates)
    ports = []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"fewer than {count} free ports below {ephemeral_low} on 127.0.0.1")


def next_engine(port: int) -> None:
    """The rendezvous port of the next engine (each engine its own: a port just closed may
    still be held)."""
    os.environ["MASTER_PORT"] = str(port)


def freeze_heap() -> None:
    """Collect, then freeze what survives (``gc.freeze``), as vLLM freezes its heap once an
    engine has started: later ``gc.collect()`` calls (vLLM makes several per engine start) no
    longer re-scan it, about 0.35 CPU-seconds a pass for the ~620,000 objects of vLLM's
    import-time heap here. vLLM unfreezes everything when an engine shuts down, and so does
    this process at exit (frozen objects would outlive interpreter shutdown, which extensions
    such as Triton's report as leaks)."""
    import atexit
    import gc

    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often the heap is frozen
    atexit.register(gc.unfreeze)


def release_parallel_state() -> None:
    """Once the caller has dropped its engine: collect it and free vLLM's process-wide parallel
    groups, so that the next engine of this process can set them up; then :func:`freeze_heap`,
    nothing of the old engine being left."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()
    freeze_heap()
