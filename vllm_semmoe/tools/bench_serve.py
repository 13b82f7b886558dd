"""``semmoe bench-serve``: serving the embedded model under a bounded ShareGPT load, DP + EP
or TP + EP.

Starts ``semmoe serve`` (vLLM's default compiled mode unless ``--enforce-eager``) with data (or
tensor) parallelism and expert parallelism on loopback, sends a bounded number of streamed
completions at a fixed concurrency, stops the server, and reports requests ok/failed, TTFT,
TPOT, throughput, a digest of the generated text, and, from the engines' own counters: the MoE
bytes they moved per token (:mod:`.ep_dispatch`), live LAR (from the routing the engines ran,
or in TP mode from the exchange) and, under DP, the prompt tokens each rank processed. Failures
of the plugin's own machinery are reported, never hidden in a figure: a capture that stopped
and MoE layers the engines could not meter (``plugin_failures``; the bytes then read ``None``,
not 0), with the server's exit status; :func:`run_problems` lists what makes a run fail.

DP policies (:data:`POLICIES`), what users would choose between:

- ``vllm``: stock vLLM (identity placement, vLLM's request balancer, its all-gather /
  reduce-scatter MoE dispatch), metered only;
- ``sparse``: as ``vllm`` but with the sparse EP dispatch (each token sent only to the ranks
  holding its experts): the saving of the dispatch alone;
- ``placement-only``: Sem-MoE's placement with the sparse dispatch, vLLM's request balancer;
- ``semmoe``: Sem-MoE's placement and request routing (mode ``dp``) with the sparse dispatch.

TP policies (:data:`TP_POLICIES`):

- ``vllm``: stock vLLM TP + EP (tokens replicated, every rank runs its experts on all of them,
  two all-reduces per decoder layer), its collectives metered;
- ``contiguous``: the shuffled pipeline (mode ``tp``) on the reduce-scatter's contiguous
  slices, identity placement (the paper's baseline);
- ``semmoe``: mode ``tp`` with Sem-MoE's placement and token schedule.
"""

from __future__ import annotations

import concurrent.futures
import glob
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
from tqdm import tqdm

from ..core.modes import Mode, ServingMode
from ..core.policy import get_policy
from .prompts import load_prompts
from ..core.tables import build_tables
from ..core.capture_store import load_trace
from ..vllm_adapter.ep_dispatch import BYTE_KEYS, EXCHANGE_KEYS


def _say(message: str) -> None:
    print(f"[semmoe] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: policy -> (placement method, engine mode, MoE dispatch)
POLICIES = {
    "vllm": ("vanilla", Mode.PLACEMENT_ONLY, "vllm"),
    "sparse": ("vanilla", Mode.PLACEMENT_ONLY, "sparse"),
    "placement-only": ("semmoe", Mode.PLACEMENT_ONLY, "sparse"),
    "semmoe": ("semmoe", Mode.DP, "sparse"),
}
#: TP + EP policy -> (placement method, engine mode)
TP_POLICIES = {
    "vllm": ("vanilla", Mode.PLACEMENT_ONLY),
    "contiguous": ("vanilla", Mode.TP),
    "semmoe": ("semmoe", Mode.TP),
}


def cpu_thread_binding(tp: int) -> dict:
    """``{"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}``-style environment for TP ``tp`` on vLLM's CPU
    build: its automatic binding gives each TP rank a NUMA node and refuses to start when there
    are fewer nodes than ranks (a one-node VM), so this process's CPUs are split evenly over the
    ranks instead. Empty where it does not apply: TP 1, a binding the user set, or a GPU."""
    if tp < 2 or not _binds_cpus():
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise ValueError(f"TP {tp} needs at least {tp} CPUs on vLLM's CPU build, this process may use {len(cpus)}")
    share = len(cpus) // tp
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cpus[r * share:(r + 1) * share]))
                                                   for r in range(tp))}


def stream_completion(base: str, model: str, prompt, max_tokens: int, timeout: float = 300) -> dict:
    """One streamed ``/v1/completions`` request: ``{"ok", "ttft_s", "latency_s", "tokens", "text"}``."""
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(base + "/v1/completions", json.dumps(payload).encode(),
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    ttft, tokens, text = None, 0, []
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text.append(chunk["choices"][0].get("text", ""))
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return {"ok": ttft is not None, "ttft_s": ttft, "latency_s": time.perf_counter() - start, "tokens": tokens,
                "text": "".join(text)}
    except urllib.error.HTTPError as exc:
        return {"ok": False, "error": f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}"}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return {"ok": False, "error": str(exc)}


def run_bench_serve(model: str, dataset: str, workdir: str, *, dp: int = 2, tp: int = 1, policy: str = "semmoe",
                    num_prompts: int = 200, concurrency: int = 16, max_tokens: int = 32,
                    profile_trace: str | None = None, profile_prompts: int = 300, skip: int = 3000,
                    max_model_len: int = 1024, startup_timeout: float = 900, dp_balance: float | None = None,
                    dp_price_step: float | None = None, dp_slack: float | None = None, dtype: str = "bfloat16",
                    redundant: int = 0, enforce_eager: bool = False, nodes: int = 1,
                    api_server_count: int | None = None) -> dict:
    """Serve ``model`` with DP=``dp`` + EP (``tp`` 1) or TP=``tp`` + EP (``tp`` > 1, ``dp`` 1) and
    measure the ``policy`` (one of :data:`POLICIES`, or of :data:`TP_POLICIES` under TP).
    ``redundant``: replica slots per rank of the Sem-MoE placement (the policies on stock
    vLLM's placement have none). ``dp_balance`` / ``dp_price_step``: the DP router's knobs
    and guard (``semmoe serve --dp-balance / --dp-price-step / --dp-slack``; ``None``: the plugin's
    defaults). ``skip``: prompts of ``dataset`` skipped first; the profile takes the next
    ``profile_prompts``, the served prompts follow them. ``nodes``: under DP, the deployment as
    that many process trees launched the way vLLM launches nodes (:func:`node_commands`), each
    with a capture directory of its own.
    ``enforce_eager``: serve with ``--enforce-eager``; by default in vLLM's default compiled
    mode, as ``vllm serve`` does (each engine compiles at start-up; piecewise CUDA graphs where
    there are CUDA graphs), the collectives inside the compiled graph counted by
    :class:`~.ep_dispatch.CollectiveMeter`. ``api_server_count``: API server processes (vLLM's
    ``--api-server-count``; ``None``: vLLM's default, one per DP rank). The engines' MoE counters
    reach ``/metrics`` (``metrics`` of the result) only with more than one; the run's figures come
    from the engines' own counters files either way."""
    if tp > 1 and dp != 1:
        raise ValueError(f"bench-serve runs DP + EP or TP + EP, not both (dp {dp}, tp {tp})")
    if nodes < 1 or dp % nodes or (nodes > 1 and tp > 1):
        raise ValueError(f"bench-serve spreads DP ranks over nodes: {nodes} nodes cannot hold DP {dp}"
                         + (" (multi-node runs are DP + EP)" if tp > 1 else ""))
    policies = TP_POLICIES if tp > 1 else POLICIES
    if policy not in policies:
        raise ValueError(f"policy must be one of {', '.join(policies)} under {'TP' if tp > 1 else 'DP'}, "
                         f"got {policy!r}")
    os.makedirs(workdir, exist_ok=True)
    # what the work directory caches (the default profile, the tables solved on it) is named by the
    # prompts it came from, so that another --skip never reuses them
    window = "" if skip == 3000 or profile_trace is not None else f"_skip{skip}"
    if profile_trace is None:
        from .profiling import profile

        profile_trace = os.path.join(workdir, f"profile{window}.npz")
        if not os.path.exists(profile_trace):
            profile(model, dataset, profile_prompts, profile_trace, skip=skip)
    trace = load_trace(profile_trace)
    ep, solve_mode = (tp, ServingMode.TP) if tp > 1 else (dp, ServingMode.DP)
    if tp > 1:
        (method, mode), dispatch = TP_POLICIES[policy], None
    else:
        method, mode, dispatch = POLICIES[policy]
    solver = get_policy(method)
    R = int(redundant) if solver.supports_redundant else 0
    replicas = f"_r{R}" if R else ""
    tables_dir = os.path.join(workdir, f"tables_{method}_{solve_mode}{ep}{replicas}{window}")
    if not os.path.isdir(tables_dir):
        build_tables(trace, solver.solve(trace, ep, mode=solve_mode, redundant=R),
                     mode=solve_mode).save(tables_dir)
    name = f"{policy}{'_tp' if tp > 1 else ''}{replicas}"
    homes = [workdir] if nodes == 1 else [os.path.join(workdir, f"node{k}") for k in range(nodes)]
    captures = [os.path.join(home, f"served_{name}.npz") for home in homes]  # one per node: no shared disk
    for capture in captures:
        os.makedirs(os.path.dirname(capture), exist_ok=True)
        for stale in set(glob.glob(capture.replace(".npz", ".*live.json")) + glob.glob(capture.replace(".npz", ".dp*"))):
            os.remove(stale)
        shutil.rmtree(capture + ".parts", ignore_errors=True)
    prompts = _fit(model, load_prompts(dataset, num_prompts, skip=skip + profile_prompts), max_model_len - max_tokens)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm_semmoe.cli", "serve", model, "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--no-enable-prefix-caching", "--enable-expert-parallel",
           "--tables", tables_dir, "--mode", str(mode)]
    if enforce_eager:
        cmd.append("--enforce-eager")
    else:  # the capture and the sparse dispatch run Python every step: on CUDA, piecewise graphs that
        # split at the plugin's ops (full graphs are refused at start); the CPU build has no CUDA graphs
        cmd += ["--compilation-config", json.dumps({"cudagraph_mode": "PIECEWISE"})]
    cmd += ["--tensor-parallel-size", str(tp)] if tp > 1 else ["--data-parallel-size", str(dp), "--dispatch", dispatch]
    for flag, value in (("--dp-balance", dp_balance), ("--dp-price-step", dp_price_step), ("--dp-slack", dp_slack)):
        if value is not None:
            cmd += [flag, str(value)]
    api = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "model"]
    if api_server_count is not None:
        api += ["--api-server-count", str(api_server_count)]
    if nodes == 1:
        commands = [(cmd + api + ["--capture", captures[0]], cpu_thread_binding(tp))]
    else:
        commands = [(command + ["--capture", capture], env) for (command, env), capture
                    in zip(node_commands(cmd, api, dp, nodes, free_port()), captures)]
    logs = [os.path.join(home, f"server_{policy}{replicas}.log") for home in homes]
    layout = f"TP {tp}" if tp > 1 else f"DP {dp}" + (f" on {nodes} nodes" if nodes > 1 else "")
    _say(f"starting {policy} server ({layout} + EP), log{'s' if nodes > 1 else ''} in {', '.join(logs)}")
    servers = []
    try:
        for (command, env), log_path in zip(commands, logs):
            with open(log_path, "w") as log:
                servers.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                                stdin=subprocess.DEVNULL, env={**os.environ, **env}))
        wait_healthy(base, servers, startup_timeout * nodes, logs)
        _say(f"sending {len(prompts)} requests at concurrency {concurrency}")
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            results = list(tqdm(pool.map(lambda p: stream_completion(base, "model", p, max_tokens), prompts),
                                total=len(prompts), desc=f"[bench-serve] {policy} requests", file=sys.stderr))
        wall = time.perf_counter() - start
        time.sleep(1.0)  # let the engines finish writing their counters
        metrics = scrape_metrics(base)
    finally:
        # the API server's node first (vLLM's front end ends the deployment), then the headless ones
        statuses = [stop_server(server) for server in servers]
    exit_status = next((status for status in statuses if status), statuses[0] if statuses else None)
    per_rank = [captures[rank * nodes // dp] for rank in range(dp)] if tp == 1 else captures[0]
    summary = _summarise(policy, dp, tp, results, wall, per_rank, num_prompts, concurrency, max_tokens)
    summary["metrics"] = metrics
    summary["server_exit_status"] = exit_status
    # a failure the live counters could not carry (they stopped, or were never written) still counts
    for name, kind in (("capture_errors_total", "capture_error"), ("unmetered_moe_layers_total", "unmetered")):
        if metrics.get(name) and not any(f["kind"] == kind for f in summary["plugin_failures"]):
            summary["plugin_failures"].append({"rank": None, "kind": kind,
                                               "reason": f"/metrics: {name} {metrics[name]}"})
    if any(f["kind"] == "unmetered" for f in summary["plugin_failures"]):
        summary["moe_bytes_per_token"] = None
    summary["dtype"] = dtype
    summary["redundant"] = R
    summary["nodes"] = nodes
    summary["compiled"] = all(engines_compiled(log_path) for log_path in logs)
    if summary["compiled"] == enforce_eager:
        _say(f"warning: asked to serve {'eager' if enforce_eager else 'compiled'}, but the engines' config "
             f"says otherwise ({', '.join(logs)})")
    return summary


def node_commands(cmd: list[str], api: list[str], dp: int, nodes: int, rpc_port: int) -> list[tuple[list[str], dict]]:
    """``(command, environment)`` of each node of a DP ``dp`` deployment spread over ``nodes``
    process trees on this machine, as vLLM launches nodes: node 0 runs the API server (``api``,
    its address options) and DP ranks ``0 .. dp/nodes - 1``; node ``k`` runs ``--headless
    --data-parallel-start-rank k * dp/nodes``; all reach node 0 at ``--data-parallel-address
    127.0.0.1 --data-parallel-rpc-port rpc_port``. ``cmd``: the ``semmoe serve`` command every
    node shares (it holds ``--data-parallel-size dp``). Each node's ranks are bound to a share
    of this process's CPUs (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's CPU build would bind every
    node's first rank to the same CPUs), unless a binding is set or a GPU is present."""
    local = dp // nodes
    shared = ["--data-parallel-size-local", str(local), "--data-parallel-address", "127.0.0.1",
              "--data-parallel-rpc-port", str(rpc_port)]
    cpus = sorted(os.sched_getaffinity(0))
    out = []
    for k in range(nodes):
        role = api if k == 0 else ["--headless", "--data-parallel-start-rank", str(k * local)]
        env = {}
        if _binds_cpus():
            mine = [cpus[(k * local + r) % len(cpus)] for r in range(local)] if len(cpus) < dp else \
                cpus[k * len(cpus) // nodes:(k + 1) * len(cpus) // nodes]
            share = max(len(mine) // local, 1)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(map(str, mine[r * share:(r + 1) * share] or mine[-1:])) for r in range(local))
        out.append((cmd + shared + role, env))
    return out


def _binds_cpus() -> bool:
    """Whether bench-serve binds the ranks' threads (vLLM's CPU build, no binding the user set)."""
    return "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and not _has_cuda()


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def engines_compiled(log_path: str) -> bool:
    """Whether a server's engines ran compiled: every engine config line in its log (``... with
    config: ... enforce_eager=False, ...``, logged by vLLM's engine core at start) says so. Read
    from the engine, not from the flags it was started with; ``RuntimeError`` naming the log when
    it holds no such line."""
    flags = []
    with open(log_path, errors="replace") as log:
        for line in log:
            if "with config:" in line and "enforce_eager=" in line:
                flags.append(line.split("enforce_eager=", 1)[1].split(",", 1)[0].strip())
    if not flags:
        raise RuntimeError(f"no vLLM engine config line (enforce_eager=...) in {log_path}")
    return all(flag == "False" for flag in flags)


def scrape_metrics(base: str) -> dict:
    """The server's ``vllm:semmoe_*`` counters from ``/metrics``, summed over DP ranks:
    ``{"moe_bytes_total": {op: bytes}, "local_activations_total": n, "remote_activations_total": n}``,
    the failure counters ``capture_errors_total`` and ``unmetered_moe_layers_total`` and, from the
    DP router, ``requests_total``, ``prompt_tokens_total``, ``generated_tokens_total``,
    ``finished_requests_total`` (empty when the server exports none)."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError as exc:
        _say(f"could not read {base}/metrics: {exc}")
        return {}
    return parse_metrics(text)


def parse_metrics(text: str) -> dict:
    """The ``vllm:semmoe_*`` counters of a ``/metrics`` page (:func:`scrape_metrics`)."""
    out: dict = {}
    for line in text.splitlines():
        if not line.startswith("vllm:semmoe_") or "_created" in line.split(" ")[0]:
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        name = name.removeprefix("vllm:semmoe_")
        if name == "moe_bytes_total":
            op = labels.split('op="', 1)[1].split('"', 1)[0]
            out.setdefault(name, {}).setdefault(op, 0)
            out[name][op] += int(float(value))
        elif name in ("local_activations_total", "remote_activations_total", "requests_total",
                      "prompt_tokens_total", "generated_tokens_total", "finished_requests_total",
                      "capture_errors_total", "unmetered_moe_layers_total"):
            out[name] = out.get(name, 0) + int(float(value))
    return out


def _fit(model: str, prompts: list[str], budget: int) -> list[list[int]]:
    """Token ids of each prompt, left-truncated so prompt + completion fit the context."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [tokenizer.encode(p)[-budget:] for p in prompts]


def wait_healthy(base: str, servers, timeout: float, logs) -> float:
    """Poll ``base/health`` until 200 and return the seconds it took. ``servers``: the server's
    process, or several processes that together serve ``base`` (the nodes of a multi-node
    deployment); ``logs``: their log path(s), one per process. ``RuntimeError`` with the tail of
    every log when one of the processes exits or ``timeout`` seconds pass first."""
    servers = list(servers) if isinstance(servers, (list, tuple)) else [servers]
    logs = [str(path) for path in logs] if isinstance(logs, (list, tuple)) else [str(logs)]
    if len(logs) != len(servers):
        raise ValueError(f"wait_healthy: {len(servers)} processes but {len(logs)} logs")
    started = time.monotonic()
    while True:
        for index, server in enumerate(servers):
            if server.poll() is not None:
                which = "server" if len(servers) == 1 else f"process {index} of {len(servers)}"
                raise RuntimeError(f"{which} exited with code {server.returncode} during start-up\n"
                                   + _log_tails(logs))
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"{base} not healthy after {timeout:.0f} s\n" + _log_tails(logs))
        time.sleep(1.0)


def _log_tails(logs: list[str], chars: int = 3000) -> str:
    """The last ``chars`` characters of each log, headed by its path."""
    tails = []
    for path in logs:
        try:
            with open(path, errors="replace") as f:
                tails.append(f"--- {path} ---\n{f.read()[-chars:]}")
        except OSError as exc:
            tails.append(f"--- {path} --- (unreadable: {exc})")
    return "\n".join(tails)


def stop_server(server) -> int:
    """SIGTERM the server's process group (engines flush their captures on exit), wait, and return
    its exit status (``semmoe serve``: non-zero when the plugin's machinery failed while serving)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    return server.returncode


def run_problems(run: dict) -> list[str]:
    """What makes a bench-serve run fail (empty: it did not): failed requests, failures of the
    plugin's machinery (a capture that stopped, unmetered MoE bytes), the server's exit status."""
    problems = [f"{run['failed']} requests failed"] if run["failed"] else []
    problems += [f"{f['kind']}" + (f" (rank {f['rank']})" if f["rank"] is not None else "")
                 + (f" (repetition {f['repetition'] + 1})" if "repetition" in f else "") + f": {f['reason']}"
                 for f in run.get("plugin_failures", [])]
    if run.get("server_exit_status"):
        problems.append(f"the server exited with status {run['server_exit_status']}")
    return problems


#: the figures ``bench-serve --repeat`` reports the median and spread of
REPEAT_KEYS = ("ttft_p50_s", "ttft_p99_s", "tpot_s", "throughput_tok_s", "moe_bytes_per_token")


def repeat_schedule(names: list, repeat: int) -> list[tuple[int, object]]:
    """``(repetition, name)`` in the order ``bench-serve --repeat`` runs them: every repetition
    runs each name once, its order rotated by one place per repetition (two names alternate: A B,
    B A, A B), so that a drift of a shared machine over time falls on every policy alike."""
    return [(k, names[(k + i) % len(names)]) for k in range(repeat) for i in range(len(names))]


def aggregate_repeats(runs: list[dict]) -> dict:
    """One policy's repetitions (:func:`run_bench_serve` results, in the order they ran) as one
    run: the keys of :data:`REPEAT_KEYS` are the medians over the repetitions (``None`` where any
    repetition's is ``None``: bytes unmetered), ``spread`` holds each one's ``median``, ``min``,
    ``max`` and ``sd`` (sample standard deviation), ``repeats`` every repetition's full result.
    ``ok`` and ``failed`` count the requests of all repetitions, ``plugin_failures`` and
    ``errors`` are those of all (each failure naming its ``repetition``), ``server_exit_status``
    the first non-zero one, ``compiled`` whether every repetition ran compiled; the other keys
    (placement, layout, per-rank load, bytes per op, digest) are the first repetition's. One
    repetition is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    spread: dict = {}
    for key in REPEAT_KEYS:
        values = [run[key] for run in runs]
        if any(value is None for value in values):
            out[key] = spread[key] = None
            continue
        values = np.asarray(values, float)
        out[key] = float(np.median(values))
        spread[key] = {"median": out[key], "min": float(values.min()), "max": float(values.max()),
                       "sd": float(values.std(ddof=1))}
    out["ok"] = sum(run["ok"] for run in runs)
    out["failed"] = sum(run["failed"] for run in runs)
    out["plugin_failures"] = [{**failure, "repetition": k} for k, run in enumerate(runs)
                              for failure in run["plugin_failures"]]
    out["errors"] = sorted({e for run in runs for e in run["errors"]})[:5]
    out["server_exit_status"] = next((run["server_exit_status"] for run in runs if run["server_exit_status"]),
                                     runs[0]["server_exit_status"])
    out["compiled"] = all(run["compiled"] for run in runs)
    out["repeat"] = len(runs)
    out["spread"] = spread
    out["repeats"] = runs
    return out


def _summarise(policy, dp, tp, results, wall, capture, num_prompts, concurrency, max_tokens) -> dict:
    """The run's figures from the requests' results and the engines' live counters files (one
    per DP rank, or per TP rank under TP: :func:`.recording.live_counters_path`). ``capture``:
    the server's ``--capture`` path, or under DP a list of each rank's (its node's)."""
    ok = [r for r in results if r.get("ok")]
    rank_prompt_tokens, local, remote, tokens = [], 0, 0, 0
    traffic: dict = {}
    failures = []
    captures = [capture] * (tp if tp > 1 else dp) if isinstance(capture, str) else list(capture)
    paths = ([f"{os.path.splitext(captures[0])[0]}.npz.tp{t}.live.json" for t in range(tp)] if tp > 1 else
             [f"{os.path.splitext(captures[rank])[0]}.dp{rank}.npz.live.json" for rank in range(dp)])
    for rank, path in enumerate(paths):
        if not os.path.exists(path):
            raise RuntimeError(f"engine rank {rank} wrote no live counters ({path}); see the server log")
        with open(path) as f:
            live = json.load(f)
        failures += [{"rank": rank, "kind": kind, "reason": reason}
                     for kind, reason in live.get("failures", {}).items()]
        if "moe_traffic" not in live:
            raise RuntimeError(f"engine rank {rank} counted no MoE traffic ({path}); is it running with EP?")
        moved = live["moe_traffic"]
        for key in BYTE_KEYS:
            traffic[key] = traffic.get(key, 0) + int(moved[key])
        if tp > 1:  # every TP rank sees every token; locality is what the exchange found
            local += int(moved["local_activations"])
            remote += int(moved["remote_activations"])
            tokens = int(live["tokens"])
            rank_prompt_tokens = [int(live["prompt_tokens"])]
        else:
            local += live["local_activations"]
            remote += live["remote_activations"]
            rank_prompt_tokens.append(int(live["prompt_tokens"]))
            tokens += int(live["tokens"])
    traffic = {key: value for key, value in traffic.items() if value or key in EXCHANGE_KEYS}
    loads = np.asarray(rank_prompt_tokens, float)
    tpots = [(r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    completion_tokens = sum(r["tokens"] for r in ok)
    digest = hashlib.sha256(json.dumps([r.get("text") for r in results]).encode()).hexdigest()[:16]
    return {
        "policy": policy,
        "dp": dp,
        "tp": tp,
        "ok": len(ok),
        "failed": len(results) - len(ok),
        # None: some MoE layer's exchange was not metered (plugin_failures says which)
        "moe_bytes_per_token": None if any(f["kind"] == "unmetered" for f in failures)
        else sum(traffic.values()) / max(tokens, 1),
        "moe_bytes": traffic,
        "plugin_failures": failures,
        "tokens": tokens,
        # None: no exchange ran (stock TP + EP replicates tokens: every activation is computed in place)
        "live_lar": local / (local + remote) if local + remote else None,
        "rank_prompt_tokens": rank_prompt_tokens,
        "rank_imbalance": float(loads.max() / loads.mean()) if loads.sum() else float("nan"),
        "ttft_p50_s": float(np.median([r["ttft_s"] for r in ok])) if ok else float("nan"),
        "ttft_p99_s": float(np.percentile([r["ttft_s"] for r in ok], 99)) if ok else float("nan"),
        "tpot_s": float(np.median(tpots)) if tpots else float("nan"),
        "completion_tokens": completion_tokens,
        "throughput_tok_s": completion_tokens / wall,
        "output_digest": digest,
        "outputs": [r.get("text") for r in results],
        "wall_s": wall,
        "num_prompts": num_prompts,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "errors": sorted({r.get("error", "") for r in results if not r.get("ok")})[:5],
    }
