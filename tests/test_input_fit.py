"""Every command and library entry point that takes two inputs checks that they fit (layers,
experts, top-k, vocabulary, EP size) before compiled code indexes one with the other: a misfit
is one line naming both inputs and their shapes, exit status 2, never a crash or figures of a
trace scored against another model's placement."""

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_semmoe.cli import main
from vllm_semmoe.evaluation.evaluate import EvalConfig, compare_methods, evaluate
from vllm_semmoe.core.schedulers import scheduled_devices
from vllm_semmoe.tools.interop import sglang_expert_location
from vllm_semmoe.core.policy import get_policy
from vllm_semmoe.core.synthetic import synthetic_trace
from vllm_semmoe.core.tables import build_tables
from vllm_semmoe.core.trace import RoutingTrace, TraceMismatch, check_fit

# The embedded model's shape (vllm_semmoe/assets/tiny_moe/config.json): 4 MoE layers x 32 experts, top-4.
TINY = dict(num_layers=4, num_experts=32, top_k=4, vocab_size=6144)


def _trace(layers, experts, top_k, vocab=None, dialect="t", requests=6, seed=0) -> RoutingTrace:
    """A small synthetic trace; with ``vocab``, carrying ``vocab`` token strings ``dialect + id``."""
    t = synthetic_trace(num_layers=layers, num_experts=experts, top_k=top_k, vocab_size=vocab or 64,
                        num_requests=requests, mean_request_tokens=8, num_topics=2, seed=seed)
    if vocab is None:
        return t
    return RoutingTrace.from_arrays(t.tokens, t.experts, t.offsets, vocab=[f"{dialect}{i}" for i in range(vocab)],
                                    num_experts=experts)


def _one_error_line(capsys, argv) -> str:
    """Run the CLI in-process; expect exit 2 and exactly one stderr line; return it."""
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def _shape_text(layers, experts, top_k) -> str:
    return f"{layers} layers x {experts} experts, top-{top_k}"


@pytest.fixture(scope="module")
def tiny_trace_path(tmp_path_factory):
    """A trace of the embedded model's shape."""
    path = tmp_path_factory.mktemp("fit") / "tiny_4x32.npz"
    _trace(TINY["num_layers"], TINY["num_experts"], TINY["top_k"], requests=40).save(path)
    return path


# ---- the acceptance: embedded-model trace against the DeepSeek trace, both ways ----------------
@pytest.mark.parametrize("bigger_eval", [True, False], ids=["deepseek-eval", "deepseek-profile"])
def test_eval_refuses_traces_of_two_models(tiny_trace_path, dev_trace_path, bigger_eval):
    """A bigger evaluation trace than the profile crashed the process in compiled code (SIGSEGV);
    the reverse printed LAR figures of a 4 x 32 trace against a 26 x 64 placement. Both now exit
    2 with one line naming both traces and both shapes. A separate process, so a crash shows as
    its exit status instead of taking pytest down."""
    profile, held_out = (tiny_trace_path, dev_trace_path) if bigger_eval else (dev_trace_path, tiny_trace_path)
    run = subprocess.run([sys.executable, "-m", "vllm_semmoe.cli", "eval", "--profile", str(profile),
                          "--eval", str(held_out), "--method", "vanilla,semmoe", "--ep", "4"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    assert run.stdout == ""
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    line = lines[0]
    assert f"--profile {profile}" in line and f"--eval {held_out}" in line
    assert _shape_text(4, 32, 4) in line and _shape_text(26, 64, 6) in line
    assert "layers" in line and "experts" in line and "top-k" in line


# ---- the library: Python callers get the exception, not a crash or wrong figures ---------------
@pytest.fixture(scope="module")
def two_models():
    """(small trace, its vanilla placement and tables; bigger trace, its vanilla placement)."""
    small, big = _trace(2, 8, 2, requests=8), _trace(3, 16, 2, requests=8, seed=1)
    p_small, p_big = get_policy("vanilla").solve(small, 2), get_policy("vanilla").solve(big, 2)
    return small, p_small, build_tables(small, p_small), big, p_big


def test_evaluate_refuses_a_placement_of_another_shape(two_models):
    small, p_small, tables, big, p_big = two_models
    config = EvalConfig(mode="tp", batch_tokens=16)
    with pytest.raises(TraceMismatch, match=r"3 layers x 16 experts.*2 layers x 8 experts"):
        evaluate(big, p_small, None, config)  # trace ids beyond the placement: out-of-range indexing
    with pytest.raises(TraceMismatch, match=r"2 layers x 8 experts.*3 layers x 16 experts"):
        evaluate(small, p_big, None, config)  # a smaller trace: figures of the wrong model
    with pytest.raises(TraceMismatch, match="the tables"):
        evaluate(big, p_big, tables, config)
    with pytest.raises(TraceMismatch):
        scheduled_devices(big, p_small, None, config)
    assert evaluate(small, p_small, tables, config)["lar"] > 0  # the fitting pair still runs


def test_compare_methods_refuses_profile_and_evaluation_of_two_models(two_models):
    small, _, _, big, _ = two_models
    for profile, held_out in ((small, big), (big, small)):
        with pytest.raises(TraceMismatch, match="the profile trace .* and the evaluation trace"):
            compare_methods(profile, held_out, 2, ["vanilla"], EvalConfig(mode="tp"))


def test_check_fit_compares_only_what_both_carry():
    """No false refusals: a trace without token strings fits one with them; tables add top-k;
    an embedding needs a row for every token id and no more."""
    named = _trace(2, 8, 2, vocab=40)
    bare = _trace(2, 8, 2, vocab=None)
    check_fit(named, bare)
    check_fit(named, named.select_requests([0, 1]))
    check_fit(named, np.zeros((40, 3), np.float32))
    check_fit(named, np.zeros((50, 3), np.float32))
    with pytest.raises(TraceMismatch, match="a vocabulary of 40 token ids but an embedding of 39 rows"):
        check_fit(named, np.zeros((39, 3), np.float32), names=("a.npz", "ckpt"))
    with pytest.raises(TraceMismatch, match=r"vocab: 40 of 40 token strings differ \(id 0: 't0' vs 'u0'\)"):
        check_fit(named, _trace(2, 8, 2, vocab=40, dialect="u"))
    placement = get_policy("vanilla").solve(named, 4)
    check_fit(named, build_tables(named, placement))
    with pytest.raises(TraceMismatch, match="top-k 3 vs 2"):
        check_fit(_trace(2, 8, 3), build_tables(named, placement))


# ---- the property: random misfits through every command that takes two inputs ------------------
FIELDS = ("layers", "experts", "top_k", "vocab")
shapes = st.fixed_dictionaries({"layers": st.integers(1, 4), "experts": st.sampled_from([4, 8, 16]),
                                "top_k": st.integers(1, 3), "vocab": st.sampled_from([40, 64]),
                                "dialect": st.just("t")})


@st.composite
def misfits(draw):
    """Two shapes that differ in at least one of layers, experts, top-k, vocabulary (size or strings)."""
    first = draw(shapes)
    second = dict(first)
    for field in draw(st.sets(st.sampled_from(FIELDS), min_size=1)):
        if field == "vocab" and draw(st.booleans()):
            second["dialect"] = "u"  # same size, other token strings
            continue
        options = {"layers": [1, 2, 3, 4], "experts": [4, 8, 16], "top_k": [1, 2, 3], "vocab": [40, 64]}[field]
        second[field] = draw(st.sampled_from([v for v in options if v != first[field]]))
    return first, second


@pytest.fixture(scope="module")
def fit_files(tmp_path_factory):
    """``files(shape)``: (trace path, SGLang placement file of its vanilla EP-2 layout), made once per shape."""
    work = tmp_path_factory.mktemp("fit_files")
    made = {}

    def files(shape):
        key = tuple(sorted(shape.items()))
        if key not in made:
            name = "_".join(f"{k}{v}" for k, v in key)
            trace = _trace(shape["layers"], shape["experts"], shape["top_k"], shape["vocab"], shape["dialect"])
            trace_path = work / f"{name}.npz"
            trace.save(trace_path)
            p2l = np.asarray(get_policy("vanilla").solve(trace, 2).physical_to_logical())
            placement_path = work / f"{name}.placement.json"
            placement_path.write_text(json.dumps(sglang_expert_location(p2l)))
            made[key] = (trace_path, placement_path)
        return made[key]

    return files


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    """A checkpoint directory whose input embedding has fewer rows (32) than any drawn vocabulary."""
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("ckpt")
    save_file({"model.embed_tokens.weight": np.random.default_rng(0).random((32, 8), dtype=np.float32)},
              str(path / "model.safetensors"))
    return path


PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@PROPERTY
@given(pair=misfits())
def test_every_two_input_command_refuses_a_misfit(capsys, tmp_path, fit_files, pair):
    first, second = pair
    (a, a_placement), (b, b_placement) = fit_files(first), fit_files(second)

    def shape_of(s):
        return f"{_shape_text(s['layers'], s['experts'], s['top_k'])}, vocab {s['vocab']}"

    def differences(x, y):
        out = [f"{label} {x[f]} vs {y[f]}" for f, label in (("layers", "layers"), ("experts", "experts"),
                                                             ("top_k", "top-k")) if x[f] != y[f]]
        if x["vocab"] != y["vocab"]:
            out.append(f"vocab {x['vocab']} vs {y['vocab']} tokens")
        elif x["dialect"] != y["dialect"]:
            out.append("token strings differ")
        return out

    for profile, held_out, p_shape, e_shape in ((a, b, first, second), (b, a, second, first)):
        line = _one_error_line(capsys, ["eval", "--profile", str(profile), "--eval", str(held_out),
                                        "--ep", "2", "--method", "vanilla"])
        assert f"--profile {profile} ({shape_of(p_shape)})" in line
        assert f"--eval {held_out} ({shape_of(e_shape)})" in line
        assert all(d in line for d in differences(p_shape, e_shape)), line

    if first["layers"] != second["layers"] or first["experts"] != second["experts"]:  # what a placement carries
        for trace, t_shape, placement, p_shape in ((a, first, b_placement, second), (b, second, a_placement, first)):
            line = _one_error_line(capsys, ["solve", "--trace", str(trace), "--ep", "2", "--placement",
                                            str(placement), "--out", str(tmp_path / "t")])
            assert f"--trace {trace} ({shape_of(t_shape)})" in line
            assert f"--placement {placement} ({p_shape['layers']} layers x {p_shape['experts']} experts, EP 2)" in line


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=shapes, ep=st.sampled_from([3, 5, 32]), extra_layers=st.integers(1, 3))
def test_trace_and_options_commands_refuse_a_misfit(capsys, tmp_path, fit_files, small_checkpoint, shape, ep,
                                                    extra_layers):
    """The checkpoint of ``--oov-neighbours`` against the traces, and ``cost`` / ``bench-ep``'s
    trace against their EP size and ``--layers``: one line naming the trace and the other input."""
    trace, _ = fit_files(shape)
    ckpt = f"--oov-neighbours {small_checkpoint}"
    for argv in (["eval", "--profile", str(trace), "--eval", str(trace), "--ep", "2", "--method", "vanilla"],
                 ["solve", "--trace", str(trace), "--ep", "2", "--method", "vanilla", "--out", str(tmp_path / "t")]):
        line = _one_error_line(capsys, [*argv, "--oov-neighbours", str(small_checkpoint)])
        assert f"{argv[1]} {trace} (" in line and ckpt in line and "(embedding of 32 rows)" in line
        assert f"a vocabulary of {shape['vocab']} token ids but an embedding of 32 rows" in line
    layers = shape["layers"] + extra_layers
    for command, ep_option in (("cost", "--ep"), ("bench-ep", "--ranks")):
        line = _one_error_line(capsys, [command, "--trace", str(trace), ep_option, str(ep), "--max-batches", "1"])
        assert f"--trace {trace}" in line and f"{ep_option} {ep}" in line and f"{shape['experts']} experts" in line
        line = _one_error_line(capsys, [command, "--trace", str(trace), ep_option, "2", "--layers", str(layers),
                                        "--max-batches", "1"])
        assert f"--trace {trace} ({shape['layers']} layers x" in line and f"--layers {layers} ({layers} layers)" in line
