"""`semmoe import` / `semmoe export`: engines' own files in, engines' own files out.

The input files are built here in each engine's documented layout (see vllm_semmoe/tools/interop.py for
the source each layout was read from) from real DeepSeek-V2-Lite routing, so an import can be
compared with the routing it came from.
"""

import json

import numpy as np
import pytest
import torch

from vllm_semmoe.cli import main
from vllm_semmoe.tools.interop import (check_physical_to_logical, expert_devices, import_routing,
                                 load_placement_file, load_sglang_per_token, load_vllm_routed_experts,
                                 save_vllm_routed_experts, sglang_expert_location, vllm_eplb_record)
from vllm_semmoe.core.placement import PlacementError
from vllm_semmoe.core.tables import load_tables
from vllm_semmoe.core.trace import TraceError
from vllm_semmoe.core.capture_store import load_trace

DENSE = 1  # DeepSeek-V2-Lite: model layer 0 is dense (first_k_dense_replace = 1)


@pytest.fixture(scope="module")
def routing(small_trace):
    """60 real requests (26 MoE layers x 64 experts, top-6)."""
    return small_trace.select_requests(np.arange(60))


# ---- SGLang per_token dumps ----------------------------------------------------------------
def sglang_p2l(layers: int, experts: int, ep: int, redundant: int, seed: int) -> np.ndarray:
    """A physical→logical map like SGLang's EPLB makes: every expert once, plus replicas."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(layers):
        slots = np.concatenate([rng.permutation(experts), rng.choice(experts, ep * redundant, replace=False)])
        rows.append(slots)
    return np.stack(rows)


def sglang_records(trace, p2l, *, chunk: int, decode_tail: int, rank: int = 0, seed: int = 0):
    """SGLang `_DetailSinglePassGatherer` records for ``trace``'s requests.

    Prefill is chunked to ``chunk`` tokens per forward pass (a request cut at the boundary continues
    in the next pass at its next position); the last ``decode_tail`` tokens of every request are
    decoded afterwards, one token per running request per pass (extend_seq_lens None). Expert ids are
    physical (a random replica of each logical expert), -1 beyond top-k (8 columns) and in the dense
    layer 0, as SGLang records them.
    """
    rng = np.random.default_rng(seed)
    model_layers = p2l.shape[0] + DENSE
    L, N = p2l.shape[0], int(p2l.max()) + 1
    copies = np.stack([np.bincount(row, minlength=N) for row in p2l])  # [L, N] replicas per expert
    replicas = np.zeros((L, N, copies.max()), np.int64)  # [L, N, max copies] physical slots
    for l in range(L):
        for e in range(N):
            found = np.flatnonzero(p2l[l] == e)
            replicas[l, e, :len(found)] = found

    def topk_of(rows):
        out = np.full((model_layers, len(rows), 8), -1, np.int32)
        logical = trace.experts[rows].astype(np.int64).transpose(1, 0, 2)  # [L, n, k]
        pick = rng.integers(0, 1 << 30, logical.shape) % copies[np.arange(L)[:, None, None], logical]
        out[DENSE:, :, :trace.top_k] = replicas[np.arange(L)[:, None, None], logical, pick]
        return torch.from_numpy(out)

    records, pass_id = [], 0
    prefill = []  # (request, start row, end row) still to prefill
    for r in range(trace.num_requests):
        s, e = int(trace.offsets[r]), int(trace.offsets[r + 1])
        prefill.append((r, s, e - decode_tail))
    batch, room = [], chunk
    while prefill:
        r, s, e = prefill.pop(0)
        take = min(room, e - s)
        batch.append((r, s, s + take))
        room -= take
        if s + take < e:
            prefill.insert(0, (r, s + take, e))
        if room == 0 or not prefill:
            rows = np.concatenate([np.arange(a, b) for _, a, b in batch])
            starts = trace.offsets[[r for r, _, _ in batch]]
            records.append(dict(forward_pass_id=pass_id, rank=rank, gatherer_key="primary",
                                input_ids=trace.tokens[rows].tolist(),
                                positions=np.concatenate([np.arange(a, b) - st for (_, a, b), st in
                                                          zip(batch, starts)]).tolist(),
                                extend_seq_lens=[b - a for _, a, b in batch], forward_mode=1,
                                topk_ids_of_layer=topk_of(rows), misc_objects=[]))
            pass_id += 1
            batch, room = [], chunk
    for step in range(decode_tail):
        rows = np.array([trace.offsets[r + 1] - decode_tail + step for r in range(trace.num_requests)])
        records.append(dict(forward_pass_id=pass_id, rank=rank, gatherer_key="primary",
                            input_ids=trace.tokens[rows].tolist(),
                            positions=(rows - trace.offsets[:-1]).tolist(), extend_seq_lens=None,
                            forward_mode=2, topk_ids_of_layer=topk_of(rows), misc_objects=[]))
        pass_id += 1
    return records


def write_sglang_dump(path, records, p2l):
    full = np.concatenate([np.tile(np.arange(p2l.shape[1]) % (p2l.max() + 1), (DENSE, 1)), p2l])
    torch.save({"records": records, "last_physical_to_logical_map": torch.from_numpy(full)}, path)


def distinct_lengths(trace, n):
    """``n`` requests of pairwise different lengths (so decode positions identify the request)."""
    lengths = np.diff(trace.offsets)
    _, first = np.unique(lengths, return_index=True)
    return trace.select_requests(np.sort(first)[:n])


@pytest.mark.parametrize("redundant", [0, 2])
def test_sglang_prefill_imports_exactly(routing, tmp_path, redundant):
    p2l = sglang_p2l(routing.num_layers, routing.num_experts, 4, redundant, seed=redundant)
    path = tmp_path / "expert_distribution_recorder_1700000000.0_0.pt"
    write_sglang_dump(path, sglang_records(routing, p2l, chunk=512, decode_tail=0), p2l)
    result = load_sglang_per_token([path])
    trace = result.trace
    np.testing.assert_array_equal(trace.tokens, routing.tokens)
    np.testing.assert_array_equal(trace.offsets, routing.offsets)  # chunked requests stitched back
    np.testing.assert_array_equal(trace.experts, routing.experts)  # physical ids mapped to logical
    assert trace.num_experts == 64 and result.summary["dense_layers_dropped"] == [0]
    assert result.summary["fragments"] == 0 and result.summary["physical_experts"] == 64 + 4 * redundant


def test_sglang_decode_and_tp_duplicates(routing, tmp_path):
    sub = distinct_lengths(routing, 12)
    p2l = sglang_p2l(sub.num_layers, sub.num_experts, 4, 0, seed=3)
    records = sglang_records(sub, p2l, chunk=300, decode_tail=3)
    for rank in (0, 1):  # TP without DP attention: every rank records the same passes
        write_sglang_dump(tmp_path / f"expert_distribution_recorder_1.0_{rank}.pt", records, p2l)
    result = import_routing([tmp_path])  # a directory, format detected
    trace = result.trace
    np.testing.assert_array_equal(trace.tokens, sub.tokens)
    np.testing.assert_array_equal(trace.offsets, sub.offsets)
    np.testing.assert_array_equal(trace.experts, sub.experts)
    expected_decode = np.zeros(sub.num_tokens, bool)
    for r in range(sub.num_requests):
        expected_decode[sub.offsets[r + 1] - 3:sub.offsets[r + 1]] = True
    np.testing.assert_array_equal(trace.is_decode, expected_decode)
    assert result.summary["duplicate_records"] == len(records)
    prefill = load_sglang_per_token([tmp_path], prefill_only=True).trace
    assert prefill.num_tokens == sub.num_tokens - 3 * sub.num_requests and not prefill.is_decode.any()


def test_sglang_ambiguous_decode_becomes_fragments(routing, tmp_path):
    """Requests of equal length decode at equal positions: no request id says whose token it is."""
    lengths = np.diff(routing.offsets)
    values, counts = np.unique(lengths, return_counts=True)
    same = np.flatnonzero(lengths == values[np.argmax(counts)])[:2]
    assert len(same) == 2
    sub = routing.select_requests(same)
    p2l = sglang_p2l(sub.num_layers, sub.num_experts, 2, 0, seed=4)
    write_sglang_dump(tmp_path / "d.pt", sglang_records(sub, p2l, chunk=4096, decode_tail=2), p2l)
    result = load_sglang_per_token(tmp_path / "d.pt")
    assert result.summary["fragments"] == 4  # 2 decode passes x 2 requests, none attributable
    assert result.trace.num_requests == 2 + 4 and result.trace.num_tokens == sub.num_tokens


def test_sglang_bad_files_are_one_line_errors(routing, tmp_path, capsys):
    stat = tmp_path / "stat.pt"
    torch.save({"rank": 0, "logical_count": torch.zeros(3, 27, 64, dtype=torch.int32)}, stat)
    with pytest.raises(TraceError, match="`stat` dump .* per_token"):
        load_sglang_per_token(stat)
    p2l = sglang_p2l(routing.num_layers, routing.num_experts, 4, 0, seed=5)
    records = sglang_records(routing.select_requests([0]), p2l, chunk=4096, decode_tail=0)
    records[0]["positions"] = records[0]["positions"][:-1]
    bad = tmp_path / "bad.pt"
    write_sglang_dump(bad, records, p2l)
    with pytest.raises(TraceError, match=r"bad.pt: record 0: \d+ input_ids but \d+ positions"):
        load_sglang_per_token(bad)
    text = tmp_path / "notes.pt"
    text.write_text("hello")
    assert main(["import", str(text), "--out", str(tmp_path / "x.npz")]) == 2
    err = capsys.readouterr().err
    assert "notes.pt: not a readable torch.save file" in err and "Traceback" not in err and err.count("\n") == 1


# ---- vLLM routed experts -------------------------------------------------------------------
def vllm_records(trace, prompt_frac=0.75):
    """What vLLM returns per finished request: routed_experts [seq, hidden layers, k] uint8 for
    every forwarded token (prompt + output[:-1]); rows of the dense layer stay 0."""
    records = []
    for r in range(trace.num_requests):
        s, e = int(trace.offsets[r]), int(trace.offsets[r + 1])
        n_prompt = max(1, int((e - s) * prompt_frac))
        routed = np.zeros((e - s, trace.num_layers + DENSE, trace.top_k), np.uint8)
        routed[:, DENSE:] = trace.experts[s:e]
        records.append(dict(prompt=trace.tokens[s:s + n_prompt].tolist(),
                            output=trace.tokens[s + n_prompt:e].tolist() + [7],  # last sampled: never forwarded
                            routed=routed))
    return records


def test_vllm_routed_experts_from_real_request_outputs(routing, tmp_path):
    from vllm.outputs import CompletionOutput, RequestOutput

    sub = routing.select_requests(np.arange(20))
    outputs = [
        RequestOutput(request_id=str(i), prompt=None, prompt_token_ids=rec["prompt"], prompt_logprobs=None,
                      outputs=[CompletionOutput(index=0, text="", token_ids=rec["output"], cumulative_logprob=None,
                                                logprobs=None, routed_experts=rec["routed"], finish_reason="length")],
                      finished=True)
        for i, rec in enumerate(vllm_records(sub))
    ]
    path = tmp_path / "routed.pt"
    assert save_vllm_routed_experts(outputs, path) == 20
    result = load_vllm_routed_experts(path)
    np.testing.assert_array_equal(result.trace.tokens, sub.tokens)
    np.testing.assert_array_equal(result.trace.offsets, sub.offsets)
    np.testing.assert_array_equal(result.trace.experts, sub.experts)
    assert result.summary["dense_layers_dropped"] == [0]
    n_decode = sum(len(rec["output"]) - 1 for rec in vllm_records(sub))
    assert result.summary["decode_tokens"] == n_decode == int(result.trace.is_decode.sum())


def test_vllm_bad_files_are_one_line_errors(routing, tmp_path):
    rec = vllm_records(routing.select_requests([0]))[0]
    path = tmp_path / "short.pt"
    torch.save([{"prompt_token_ids": rec["prompt"], "output_token_ids": [],
                 "routed_experts": torch.from_numpy(rec["routed"].astype(np.int32))}], path)
    with pytest.raises(TraceError, match=r"short.pt: request 0: routed_experts has \d+ rows but only \d+ tokens"):
        load_vllm_routed_experts(path)
    torch.save([{"prompt_token_ids": rec["prompt"]}], path)
    with pytest.raises(TraceError, match="request 0: missing routed_experts"):
        load_vllm_routed_experts(path)


# ---- import → solve → eval, export → reload ------------------------------------------------
@pytest.fixture(scope="module")
def imported(routing, tmp_path_factory):
    """Both engines' files imported with the CLI, as traces on disk."""
    tmp = tmp_path_factory.mktemp("imported")
    p2l = sglang_p2l(routing.num_layers, routing.num_experts, 4, 1, seed=7)
    write_sglang_dump(tmp / "expert_distribution_recorder_2.0_0.pt",
                      sglang_records(routing, p2l, chunk=1024, decode_tail=2), p2l)
    torch.save([{"prompt_token_ids": r["prompt"], "output_token_ids": r["output"],
                 "routed_experts": torch.from_numpy(r["routed"].astype(np.int32))} for r in vllm_records(routing)],
               tmp / "vllm_routed.pt")
    paths = {}
    for name, src in (("sglang", tmp), ("vllm", tmp / "vllm_routed.pt")):
        paths[name] = tmp / f"{name}.npz"
        assert main(["import", str(src), "--out", str(paths[name]), "--json", str(tmp / f"{name}.json")]) == 0
        assert json.loads((tmp / f"{name}.json").read_text())["format"] == name
    return paths


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_imported_trace_solves_and_evaluates(imported, routing, tmp_path, engine):
    trace = load_trace(imported[engine])
    assert trace.num_tokens == routing.num_tokens and trace.num_layers == 26
    if engine == "vllm":  # SGLang's equal-length decodes become fragments at the end (no request ids)
        np.testing.assert_array_equal(trace.experts, routing.experts)
    tables = tmp_path / "tables"
    assert main(["solve", "--trace", str(imported[engine]), "--ep", "4", "--method", "semmoe", "--mode", "tp",
                 "--out", str(tables)]) == 0
    assert load_tables(tables).placement.num_layers == 26
    out = tmp_path / "eval.json"
    assert main(["eval", "--profile", str(imported[engine]), "--profile-frac", "0.5", "--ep", "4",
                 "--method", "vanilla,semmoe", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["methods"]
    assert rows["semmoe"]["lar"] > rows["vanilla"]["lar"]


@pytest.mark.parametrize("fmt", ["sglang", "vllm-eplb"])
def test_export_reloads_to_the_same_expert_device_map(imported, tmp_path, fmt):
    tables = tmp_path / "tables"
    assert main(["solve", "--trace", str(imported["sglang"]), "--ep", "4", "--method", "semmoe",
                 "--out", str(tables)]) == 0
    placement = load_tables(tables).placement
    out = tmp_path / f"placement_{fmt}.json"
    dense = ["--dense-layers", str(DENSE)] if fmt == "sglang" else []
    assert main(["export", "--tables", str(tables), "--format", fmt, "--out", str(out), *dense,
                 "--json", str(tmp_path / "s.json")]) == 0
    data = json.loads(out.read_text())
    if fmt == "sglang":
        assert list(data) == ["physical_to_logical_map"]  # SGLang: init_by_mapping(**data)
        assert np.asarray(data["physical_to_logical_map"]).shape == (26 + DENSE, 64)
    else:
        assert data["record_type"] == "eplb_initial_mapping" and data["version"] == 1
        assert data["num_slots"] == 64 and data["num_redundant_experts"] == 0
        assert sorted(data["initial_global_assignments"], key=int) == [str(i) for i in range(26)]
    back = load_placement_file(out, 4, dense_layers=DENSE if fmt == "sglang" else 0)
    np.testing.assert_array_equal(back.placement().expert_device, placement.expert_device)
    assert json.loads((tmp_path / "s.json").read_text())["roundtrip_ok"] is True
    # semmoe takes the engine file back: tables for the same expert→device map
    again = tmp_path / "again"
    assert main(["solve", "--trace", str(imported["sglang"]), "--ep", "4", "--placement", str(out), *dense,
                 "--out", str(again)]) == 0
    reloaded = load_tables(again).placement
    np.testing.assert_array_equal(reloaded.expert_device, placement.expert_device)
    assert reloaded.method == f"{fmt}-file"
    if fmt == "sglang":  # forgetting the dense layer is a clear error
        assert main(["solve", "--trace", str(imported["sglang"]), "--ep", "4", "--placement", str(out),
                     "--out", str(tmp_path / "x")]) == 2


def test_replicated_layout_round_trips_in_both_formats(tmp_path):
    """R redundant slots per rank: P = E * (N/E + R) slots, rank r owns slots r*S .. (r+1)*S - 1."""
    E, N, R = 4, 16, 2
    p2l = sglang_p2l(3, N, E, R, seed=11)
    held = expert_devices(p2l, E)
    assert held.shape == (3, N, E) and held.any(axis=2).all()
    (tmp_path / "s.json").write_text(json.dumps(sglang_expert_location(p2l, dense_layers=2)))
    (tmp_path / "v.json").write_text(json.dumps(vllm_eplb_record(p2l, E)))
    for name, dense in (("s.json", 2), ("v.json", 0)):
        back = load_placement_file(tmp_path / name, E, dense_layers=dense)
        assert back.redundant == R and back.num_experts == N
        np.testing.assert_array_equal(back.p2l, p2l)
        np.testing.assert_array_equal(back.expert_devices(), held)
    assert vllm_eplb_record(p2l, E)["num_redundant_experts"] == E * R


def test_bad_placement_files(tmp_path):
    p2l = sglang_p2l(2, 8, 2, 0, seed=1)
    with pytest.raises(PlacementError, match="layer 0: logical expert 3 has no physical slot"):
        check_physical_to_logical(np.where(p2l == 3, 4, p2l), 2, num_experts=8)
    (tmp_path / "x.json").write_text(json.dumps({"physical_to_logical_map": p2l.tolist(), "ep": 2}))
    with pytest.raises(PlacementError, match=r"unexpected \['ep'\]"):
        load_placement_file(tmp_path / "x.json", 2)
    record = vllm_eplb_record(p2l, 2)
    record["num_slots"] = 9
    (tmp_path / "y.json").write_text(json.dumps(record))
    with pytest.raises(PlacementError, match="num_slots 9 but 8 slots per layer"):
        load_placement_file(tmp_path / "y.json", 2)
    with pytest.raises(PlacementError, match="do not fit ep_size=3"):
        check_physical_to_logical(p2l, 3)
