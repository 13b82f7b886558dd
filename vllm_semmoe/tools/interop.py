"""Meet the engines where they are: routing they recorded in, placements they load out.

Import (→ :class:`~vllm_semmoe.core.trace.RoutingTrace`):

- **vLLM** ``enable_return_routed_experts=True`` (GPU model runner only) gives every finished
  completion ``CompletionOutput.routed_experts``, a ``[seq, num_hidden_layers, top_k]`` uint8 /
  uint16 array: one row per token the model *forwarded* — the prompt from
  ``SamplingParams.routed_experts_prompt_start`` on, then the generated tokens except the last
  (never fed back). vLLM writes no file; :func:`save_vllm_routed_experts` saves a list of
  ``RequestOutput`` as a ``torch.save`` file, a list of dicts per completion::

      {"prompt_token_ids": [P] ints, "output_token_ids": [O] ints,
       "routed_experts": [S, layers, k] tensor, "routed_experts_prompt_start": int (optional),
       "request_id": str (optional)}

  Rows of layers vLLM never routes (dense layers) stay 0 in its buffer: a layer that is 0 for
  every token is dropped as dense.
- **SGLang** ``--expert-distribution-recorder-mode per_token`` dumps (one
  ``expert_distribution_recorder_<time>_<rank>.pt`` per rank) a dict
  ``{"records": [...], "last_physical_to_logical_map": [layers, physical] tensor}``; each record
  is one forward pass: ``input_ids`` / ``positions`` ``[tokens]`` lists, ``extend_seq_lens``
  (tokens per request, prefill/extend) or ``None`` (decode: one token per request),
  ``forward_mode`` and ``topk_ids_of_layer`` ``[layers, tokens, 8]`` int32 *physical* expert ids,
  ``-1`` where unused (columns beyond the model's top-k, dense layers). Ids are mapped to logical
  experts with ``last_physical_to_logical_map``. The dump carries no request ids (a TODO in
  SGLang's recorder), so requests are rebuilt from positions: a segment starting at position 0
  opens a request; one starting at ``p > 0`` continues the single open request that ended at
  ``p - 1`` (a request takes at most one segment per pass). When several did, a prefill segment continues the one that ended the previous pass
  (SGLang's chunked prefill cuts the last request of a pass); otherwise the segment opens a request
  of its own (counted as ``fragments``: e.g. equal-length requests decoding side by side).
  Records that are identical on several ranks (TP without DP attention) are kept once. The
  ``stat`` mode's ``logical_count`` dump has no per-token data and is refused with that reason.

Export (a solved :class:`~vllm_semmoe.core.placement.Placement` → the engines' static layouts). Both
engines give EP rank ``r`` the physical slots ``r*S .. (r+1)*S - 1``, ``S = N/E + R`` (``R``
redundant slots per rank), which is what :meth:`Placement.physical_to_logical` returns:

- **SGLang** ``--init-expert-location FILE.json``: ``{"physical_to_logical_map": [layers, N + E*R]}``
  — nothing else: SGLang passes the keys to ``init_by_mapping(**data)``. Its rows are *model*
  layers: ``dense_layers`` leading non-MoE layers (DeepSeek's ``first_k_dense_replace``) get the
  identity row.
- **vLLM offline EPLB** (an open proposal, vLLM PR 41141; not merged): ``{"record_type":
  "eplb_initial_mapping", "version": 1, "num_redundant_experts": E*R, "num_slots": N + E*R,
  "initial_global_assignments": {"<moe layer>": [logical id per physical slot]}}``.

:func:`load_placement_file` reads both back (``semmoe export`` checks every file it writes).
No vLLM or SGLang import here; torch only to read ``.pt`` files.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

import numpy as np

from ..core.placement import Placement, PlacementError
from ..core.trace import RoutingTrace, TraceError

VLLM_EPLB_RECORD = "eplb_initial_mapping"


@dataclass(frozen=True)
class ImportResult:
    """An imported trace and what the import did (for the CLI summary / ``--json``)."""

    trace: RoutingTrace
    summary: dict = field(default_factory=dict)


# ---- shared helpers ------------------------------------------------------------------------
#: What ``semmoe import`` reads, for its error messages.
IMPORT_EXPECTED = ("expected saved vLLM routed experts (vllm_semmoe.tools.interop.save_vllm_routed_experts) or an "
                   "SGLang per_token dump (expert_distribution_recorder_*.pt)")


def _refused_file(path: str, torch_message: str) -> str:
    """What a file ``torch.load(weights_only=True)`` refused is, from its first bytes and torch's
    message: ``"not a readable torch.save file (a NumPy .npy array)"``, ``"a torch.save file holding
    Python objects ..."``."""
    import re
    import zipfile

    unsafe = re.search(r"Unsupported global: GLOBAL (\S+)", torch_message)
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith(b"\x93NUMPY"):
        kind = "a NumPy .npy array"
    elif head.startswith(b"PK"):
        try:
            names = zipfile.ZipFile(path).namelist()
        except (zipfile.BadZipFile, OSError):
            return "not a readable torch.save file (a damaged or truncated zip archive)"
        if any(name.endswith("data.pkl") for name in names):
            if unsafe or "Weights only load failed" in torch_message:
                held = f" ({unsafe.group(1)})" if unsafe else ""
                return (f"a torch.save file holding Python objects{held} besides tensors, lists, dicts, "
                        "strings and numbers, which semmoe does not unpickle")
            return "not a readable torch.save file (damaged)"
        kind = "a NumPy .npz archive" if names and all(n.endswith(".npy") for n in names) else "a zip archive"
    elif head.startswith(b"\x80"):
        kind = "a Python pickle" + (f" holding {unsafe.group(1)}" if unsafe else "")
    else:
        kind = "a text file" if b"\0" not in head else "an unrecognised binary file"
    return f"not a readable torch.save file ({kind})"


def _torch_load(path: str, expected: str = IMPORT_EXPECTED):
    """``torch.load(path, weights_only=True)``; a file it refuses is a one-line :class:`TraceError`
    saying what the file is not and ``expected`` (never torch's advice to unpickle it unsafely)."""
    import warnings

    import torch

    if not os.path.exists(path):
        raise TraceError(f"file not found: {path}")
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on its way to refusing a file
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle / zip / unsafe-global errors
        raise TraceError(f"{path}: {_refused_file(path, str(exc))}; {expected}") from None


def _int_array(value, what: str, ndim: int) -> np.ndarray:
    """A tensor / list / ndarray → int64 ndarray of ``ndim`` dims, or a TraceError naming ``what``."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except Exception:  # ragged lists
        raise TraceError(f"{what}: not a rectangular array") from None
    if arr.size == 0 and ndim == 1:
        arr = arr.reshape(0)
    if arr.ndim != ndim:
        raise TraceError(f"{what}: expected {ndim}-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TraceError(f"{what}: expected integers, got {arr.dtype}")
    return arr.astype(np.int64)


def _expert_dtype(num_experts: int):
    return np.uint8 if num_experts <= 256 else np.int16 if num_experts <= 32767 else np.int32


def _moe_layers(used: np.ndarray) -> np.ndarray:
    """Indices of the layers flagged in ``used`` ``[layers]`` bool (TraceError if none)."""
    layers = np.flatnonzero(used)
    if len(layers) == 0:
        raise TraceError("no layer routed any token to an expert (all rows empty)")
    return layers


# ---- vLLM ----------------------------------------------------------------------------------
def save_vllm_routed_experts(outputs, path: str | os.PathLike) -> int:
    """Save vLLM ``RequestOutput`` objects' routed experts with their token ids (``torch.save``).

    ``outputs``: what ``LLM.generate`` returned with ``enable_return_routed_experts=True``
    (duck-typed: ``.request_id``, ``.prompt_token_ids``, ``.outputs[i].token_ids`` /
    ``.routed_experts``). ``routed_experts_prompt_start`` is taken from each output's
    sampling params when present. Returns the number of completions written.
    """
    import torch

    records = []
    for out in outputs:
        start = int(getattr(getattr(out, "sampling_params", None), "routed_experts_prompt_start", 0) or 0)
        for completion in out.outputs:
            if completion.routed_experts is None:
                raise TraceError(f"request {out.request_id}: routed_experts is None; start vLLM with "
                                 "enable_return_routed_experts=True (GPU model runner)")
            records.append({
                "request_id": str(out.request_id),
                "prompt_token_ids": torch.as_tensor(list(out.prompt_token_ids), dtype=torch.int64),
                "output_token_ids": torch.as_tensor(list(completion.token_ids), dtype=torch.int64),
                "routed_experts": torch.from_numpy(np.asarray(completion.routed_experts).astype(np.int32)),
                "routed_experts_prompt_start": start,
            })
    torch.save(records, os.fspath(path))
    return len(records)


def load_vllm_routed_experts(path: str | os.PathLike, *, num_experts: int | None = None,
                             vocab_size: int | None = None) -> ImportResult:
    """Read a :func:`save_vllm_routed_experts` file (layout in the module docstring)."""
    path = os.fspath(path)
    data = _torch_load(path)
    if isinstance(data, dict) and "records" in data:
        raise TraceError(f"{path}: this is an SGLang expert-distribution dump; use --format sglang")
    if isinstance(data, dict) and "requests" in data:
        data = data["requests"]
    if not isinstance(data, (list, tuple)) or not data:
        raise TraceError(f"{path}: expected a non-empty list of per-request dicts with prompt_token_ids, "
                         f"output_token_ids and routed_experts, got {type(data).__name__}")
    tokens, experts, lengths, decode, ids = [], [], [], [], []
    shape = None
    for i, rec in enumerate(data):
        where = f"{path}: request {i}"
        if not isinstance(rec, dict):
            raise TraceError(f"{where}: expected a dict, got {type(rec).__name__}")
        missing = [k for k in ("prompt_token_ids", "routed_experts") if k not in rec]
        if missing:
            raise TraceError(f"{where}: missing {', '.join(missing)}")
        prompt = _int_array(rec["prompt_token_ids"], f"{where}: prompt_token_ids", 1)
        output = _int_array(rec.get("output_token_ids", []), f"{where}: output_token_ids", 1)
        routed = _int_array(rec["routed_experts"], f"{where}: routed_experts [seq, layers, top_k]", 3)
        start = int(rec.get("routed_experts_prompt_start", 0) or 0)
        seq = np.concatenate([prompt, output])[start:]
        rows = routed.shape[0]
        if shape is None:
            shape = routed.shape[1:]
        elif routed.shape[1:] != shape:
            raise TraceError(f"{where}: routed_experts has [layers, top_k] {routed.shape[1:]}, "
                             f"earlier requests {shape}")
        if rows == 0:
            continue
        if rows > len(seq):
            raise TraceError(f"{where}: routed_experts has {rows} rows but only {len(seq)} tokens "
                             f"(prompt {len(prompt)} + output {len(output)} - prompt start {start})")
        if rows < len(prompt) - start:
            raise TraceError(f"{where}: routed_experts has {rows} rows, fewer than the "
                             f"{len(prompt) - start} prompt tokens")
        tokens.append(seq[:rows])
        experts.append(routed)
        lengths.append(rows)
        decode.append(np.arange(start, start + rows) >= len(prompt))
        ids.append(i)
    if not tokens:
        raise TraceError(f"{path}: no request has any routed-experts rows")
    experts = np.concatenate(experts)
    if experts.min() < 0:
        raise TraceError(f"{path}: negative expert id {int(experts.min())} in routed_experts")
    layers = _moe_layers(experts.any(axis=(0, 2)))
    trace = RoutingTrace.from_arrays(
        np.concatenate(tokens).astype(np.int32),
        experts[:, layers].astype(_expert_dtype(int(experts.max()) + 1)),
        np.concatenate([[0], np.cumsum(lengths)]),
        num_experts=num_experts, vocab_size=vocab_size, request_ids=np.asarray(ids, np.int32),
        is_decode=np.concatenate(decode),
    )
    dropped = sorted(set(range(experts.shape[1])) - set(layers.tolist()))
    return ImportResult(trace, {
        "format": "vllm", "files": [path], "requests": trace.num_requests, "tokens": trace.num_tokens,
        "decode_tokens": int(trace.is_decode.sum()), "model_layers": int(experts.shape[1]),
        "moe_layers": [int(x) for x in layers], "dense_layers_dropped": dropped,
        "num_experts": trace.num_experts, "top_k": trace.top_k,
    })


# ---- SGLang --------------------------------------------------------------------------------
def sglang_dump_files(paths) -> list[str]:
    """Expand directories to their ``expert_distribution_recorder_*.pt`` files (sorted)."""
    files = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "expert_distribution_recorder_*.pt")))
            if not found:
                raise TraceError(f"{p}: no expert_distribution_recorder_*.pt files in this directory")
            files += found
        else:
            files.append(p)
    return files


def _sglang_dump(path: str) -> tuple[list, np.ndarray]:
    data = _torch_load(path)
    if not isinstance(data, dict):
        raise TraceError(f"{path}: expected the dict SGLang's recorder dumps, got {type(data).__name__}")
    if "logical_count" in data and "records" not in data:
        raise TraceError(f"{path}: an SGLang `stat` dump (logical_count per step, no tokens); record with "
                         "--expert-distribution-recorder-mode per_token to import routing")
    missing = [k for k in ("records", "last_physical_to_logical_map") if k not in data]
    if missing:
        raise TraceError(f"{path}: not an SGLang per_token dump (missing {', '.join(missing)})")
    p2l = _int_array(data["last_physical_to_logical_map"], f"{path}: last_physical_to_logical_map", 2)
    if not isinstance(data["records"], (list, tuple)):
        raise TraceError(f"{path}: records: expected a list of forward passes")
    return list(data["records"]), p2l


def load_sglang_per_token(paths, *, num_experts: int | None = None, vocab_size: int | None = None,
                          prefill_only: bool = False) -> ImportResult:
    """Read SGLang ``per_token`` dumps (files or directories; layout in the module docstring)."""
    files = sglang_dump_files([paths] if isinstance(paths, (str, os.PathLike)) else paths)
    p2l_ref = None
    seen = set()
    # (file, tokens, topk [layers, n, 8] physical, positions, is_decode, ends its pass, pass id)
    segments = []
    duplicates = 0
    for fi, path in enumerate(files):
        records, p2l = _sglang_dump(path)
        if p2l_ref is None:
            p2l_ref, p2l_file = p2l, path
        elif p2l.shape != p2l_ref.shape or not np.array_equal(p2l, p2l_ref):
            raise TraceError(f"{path}: last_physical_to_logical_map differs from {p2l_file}'s; "
                             "import dumps of one server run together")
        for ri, rec in enumerate(records):
            where = f"{path}: record {ri}"
            if not isinstance(rec, dict):
                raise TraceError(f"{where}: expected a dict, got {type(rec).__name__}")
            missing = [k for k in ("input_ids", "positions", "topk_ids_of_layer") if k not in rec]
            if missing:
                raise TraceError(f"{where}: missing {', '.join(missing)} (is this a per_token dump?)")
            ids = _int_array(rec["input_ids"], f"{where}: input_ids", 1)
            pos = _int_array(rec["positions"], f"{where}: positions", 1)
            topk = _int_array(rec["topk_ids_of_layer"], f"{where}: topk_ids_of_layer [layers, tokens, k]", 3)
            n = len(ids)
            if len(pos) != n or topk.shape[1] != n:
                raise TraceError(f"{where}: {n} input_ids but {len(pos)} positions and "
                                 f"{topk.shape[1]} topk_ids_of_layer rows")
            if topk.shape[0] != p2l_ref.shape[0]:
                raise TraceError(f"{where}: topk_ids_of_layer has {topk.shape[0]} layers, "
                                 f"last_physical_to_logical_map {p2l_ref.shape[0]}")
            if n == 0:
                continue
            key = (rec.get("forward_pass_id"), ids.tobytes(), pos.tobytes())
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            lens = rec.get("extend_seq_lens")
            is_decode = lens is None or len(lens) == 0
            lens = np.ones(n, np.int64) if is_decode else _int_array(lens, f"{where}: extend_seq_lens", 1)
            if lens.sum() != n or lens.min() < 1:
                raise TraceError(f"{where}: extend_seq_lens sum to {int(lens.sum())}, not the {n} input_ids")
            if is_decode and prefill_only:
                continue
            bounds = np.concatenate([[0], np.cumsum(lens)])
            for s, e in zip(bounds[:-1], bounds[1:]):
                segments.append((fi, ids[s:e], topk[:, s:e], pos[s:e], is_decode, e == n, len(seen)))
    if not segments:
        raise TraceError(f"{', '.join(files)}: no tokens recorded" + (" outside decode" if prefill_only else ""))

    # requests from positions: per rank file, continue the unique open request ending at p-1
    requests: list[list[int]] = []  # segment indices per request
    open_at: dict[tuple[int, int], list[int]] = {}  # (file, next position) -> request indices
    last_of_pass: dict[int, int] = {}  # file -> request that ended the previous pass
    pass_of: list[int] = []  # request -> pass it was last extended in (one segment per pass)
    fragments = 0
    for si, (fi, _, _, pos, decode_seg, ends_pass, pid) in enumerate(segments):
        start = int(pos[0])
        waiting = open_at.get((fi, start), []) if start > 0 else []
        candidates = [r for r in waiting if pass_of[r] != pid]
        if len(candidates) > 1 and not decode_seg and last_of_pass.get(fi) in candidates:
            candidates = [last_of_pass[fi]]
        if len(candidates) == 1:
            r = candidates[0]
            waiting.remove(r)
            pass_of[r] = pid
        else:
            fragments += start > 0
            r = len(requests)
            requests.append([])
            pass_of.append(pid)
        requests[r].append(si)
        open_at.setdefault((fi, int(pos[-1]) + 1), []).append(r)
        if ends_pass:
            last_of_pass[fi] = r

    order = [si for req in requests for si in req]
    tokens = np.concatenate([segments[si][1] for si in order])
    topk = np.concatenate([segments[si][2] for si in order], axis=1)  # [layers, T, 8] physical
    decode = np.concatenate([np.full(len(segments[si][1]), segments[si][4]) for si in order])
    lengths = [sum(len(segments[si][1]) for si in req) for req in requests]

    used_layers = (topk != -1).any(axis=(1, 2))
    layers = _moe_layers(used_layers)
    topk = topk[layers]
    cols = np.flatnonzero((topk != -1).any(axis=(0, 1)))
    k = len(cols)
    if not np.array_equal(cols, np.arange(k)):
        raise TraceError(f"{files[0]}: topk_ids_of_layer uses columns {cols.tolist()}, expected a prefix 0..k-1")
    topk = topk[:, :, :k]
    if (topk == -1).any():
        l, t, _ = np.argwhere(topk == -1)[0]
        raise TraceError(f"{files[0]}: token {t} has no expert (-1) in MoE layer {layers[l]} while others "
                         f"have {k}; fused shared experts or a partial dump are not supported")
    P = p2l_ref.shape[1]
    if topk.min() < 0 or topk.max() >= P:
        raise TraceError(f"{files[0]}: physical expert id {int(topk.max())} outside the map's {P} slots")
    logical = p2l_ref[layers[:, None, None], topk]  # [L, T, k]
    n_logical = int(p2l_ref.max()) + 1
    trace = RoutingTrace.from_arrays(
        tokens.astype(np.int32), np.transpose(logical, (1, 0, 2)).astype(_expert_dtype(n_logical)),
        np.concatenate([[0], np.cumsum(lengths)]),
        num_experts=num_experts if num_experts is not None else n_logical, vocab_size=vocab_size,
        is_decode=decode,
    )
    return ImportResult(trace, {
        "format": "sglang", "files": files, "requests": trace.num_requests, "tokens": trace.num_tokens,
        "decode_tokens": int(decode.sum()), "fragments": fragments, "duplicate_records": duplicates,
        "model_layers": int(p2l_ref.shape[0]), "moe_layers": [int(x) for x in layers],
        "dense_layers_dropped": [int(x) for x in np.flatnonzero(~used_layers)],
        "physical_experts": int(P), "num_experts": trace.num_experts, "top_k": trace.top_k,
    })


def detect_import_format(path: str | os.PathLike) -> str:
    """``"sglang"`` or ``"vllm"`` from a file's content (directories are SGLang dump folders)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return "sglang"
    data = _torch_load(path)
    if isinstance(data, dict) and ("records" in data or "logical_count" in data):
        return "sglang"
    if isinstance(data, (list, tuple)) or (isinstance(data, dict) and "requests" in data):
        return "vllm"
    raise TraceError(f"{path}: neither an SGLang per_token dump (dict with records) nor saved vLLM "
                     "routed experts (list of dicts with routed_experts)")


def import_routing(paths, fmt: str = "auto", **kwargs) -> ImportResult:
    """Import ``paths`` as ``fmt`` (``vllm``, ``sglang`` or ``auto``)."""
    paths = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    if fmt == "auto":
        kinds = {detect_import_format(p) for p in paths}
        if len(kinds) > 1:
            raise TraceError(f"mixed formats among {', '.join(paths)}; import one engine's files at a time")
        fmt = kinds.pop()
    if fmt == "sglang":
        return load_sglang_per_token(paths, **kwargs)
    if fmt == "vllm":
        kwargs.pop("prefill_only", None)
        if len(paths) != 1:
            raise TraceError("vllm: give one saved routed-experts file")
        return load_vllm_routed_experts(paths[0], **kwargs)
    raise TraceError(f"unknown import format {fmt!r}; choose from auto, vllm, sglang")


# ---- export --------------------------------------------------------------------------------
def _physical_layout(placement: Placement) -> tuple[np.ndarray, int]:
    """``([L, E*(N/E+R)] physical → logical, R redundant slots per rank)``; R = 0 without replicas."""
    p2l = np.asarray(placement.physical_to_logical(), dtype=np.int64)
    redundant = int(getattr(placement, "redundant", 0) or 0)
    expected = placement.ep_size * (placement.num_experts // placement.ep_size + redundant)
    if p2l.shape != (placement.num_layers, expected):
        raise PlacementError(f"physical_to_logical has shape {p2l.shape}, expected "
                             f"({placement.num_layers}, {expected}) for R={redundant}")
    return p2l, redundant


def check_physical_to_logical(p2l, ep_size: int, num_experts: int | None = None) -> tuple[np.ndarray, int, int]:
    """Validate an engine's ``[L, P]`` physical→logical map; returns ``(p2l, N, R)``.

    Every logical expert ``0..N-1`` must hold at least one slot, and ``P = E * (N/E + R)``.
    """
    p2l = np.asarray(p2l)
    if p2l.ndim != 2 or p2l.size == 0:
        raise PlacementError(f"physical_to_logical_map: expected [layers, physical experts], got shape {p2l.shape}")
    if not np.issubdtype(p2l.dtype, np.integer):
        raise PlacementError(f"physical_to_logical_map: expected integers, got {p2l.dtype}")
    p2l = p2l.astype(np.int64)
    L, P = p2l.shape
    N = int(num_experts) if num_experts is not None else int(p2l.max()) + 1
    E = int(ep_size)
    if p2l.min() < 0 or p2l.max() >= N:
        raise PlacementError(f"physical_to_logical_map: ids {p2l.min()}..{p2l.max()} outside 0..{N - 1}")
    if E < 1 or N % E or P % E or P < N:
        raise PlacementError(f"{P} physical slots / {N} logical experts do not fit ep_size={E} "
                             "(need N and P divisible by E, P >= N)")
    for l in range(L):
        held = np.bincount(p2l[l], minlength=N)
        if (held == 0).any():
            raise PlacementError(f"layer {l}: logical expert {int(np.argmin(held))} has no physical slot")
    return p2l, N, (P - N) // E


def sglang_expert_location(p2l, *, dense_layers: int = 0) -> dict:
    """SGLang's ``--init-expert-location`` content for ``[L, P]`` MoE-layer slots.

    ``dense_layers`` leading model layers without experts get the identity row
    (SGLang's ``init_trivial``: ``arange(P) % N``), since SGLang indexes model layers.
    """
    p2l = np.asarray(p2l, dtype=np.int64)
    N = int(p2l.max()) + 1
    trivial = np.tile(np.arange(p2l.shape[1]) % N, (int(dense_layers), 1))
    return {"physical_to_logical_map": np.concatenate([trivial, p2l]).tolist()}


def vllm_eplb_record(p2l, ep_size: int) -> dict:
    """The offline-EPLB ``eplb_initial_mapping`` record (vLLM PR 41141, an open proposal)."""
    p2l, N, R = check_physical_to_logical(p2l, ep_size)
    return {
        "record_type": VLLM_EPLB_RECORD,
        "version": 1,
        "num_redundant_experts": int(R * ep_size),
        "num_slots": int(p2l.shape[1]),
        "initial_global_assignments": {str(l): [int(x) for x in row] for l, row in enumerate(p2l)},
    }


EXPORT_FORMATS = ("sglang", "vllm-eplb")


def export_placement(placement: Placement, fmt: str, path: str | os.PathLike, *, dense_layers: int = 0) -> dict:
    """Write ``placement`` as ``fmt`` (:data:`EXPORT_FORMATS`) to ``path``; returns a summary."""
    p2l, redundant = _physical_layout(placement)
    check_physical_to_logical(p2l, placement.ep_size, placement.num_experts)
    if fmt == "sglang":
        payload = sglang_expert_location(p2l, dense_layers=dense_layers)
    elif fmt == "vllm-eplb":
        if dense_layers:
            raise PlacementError("--dense-layers applies to SGLang only (vLLM's EPLB counts MoE layers)")
        payload = vllm_eplb_record(p2l, placement.ep_size)
    else:
        raise PlacementError(f"unknown export format {fmt!r}; choose from {', '.join(EXPORT_FORMATS)}")
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f)
        f.write("\n")
    return {"format": fmt, "path": path, "moe_layers": int(p2l.shape[0]), "dense_layers": int(dense_layers),
            "num_experts": placement.num_experts, "ep_size": placement.ep_size,
            "redundant_per_rank": redundant, "physical_slots": int(p2l.shape[1]), "method": placement.method}


# ---- load back -----------------------------------------------------------------------------
@dataclass(frozen=True)
class PlacementFile:
    """An engine placement file read back: ``p2l`` ``[L, P]`` MoE-layer slots on ``ep_size`` ranks."""

    p2l: np.ndarray
    ep_size: int
    num_experts: int
    redundant: int
    fmt: str

    def expert_devices(self) -> np.ndarray:
        """``[L, N, E]`` bool: which ranks hold a copy of each logical expert."""
        return expert_devices(self.p2l, self.ep_size, self.num_experts)

    def placement(self, method: str = "") -> Placement:
        """The :class:`Placement`: each rank's first ``N/E`` slots are its home experts, the
        other ``R`` its replicas (:meth:`Placement.from_physical_to_logical`)."""
        return Placement.from_physical_to_logical(self.p2l, self.ep_size, method, self.num_experts)


def expert_devices(p2l, ep_size: int, num_experts: int | None = None) -> np.ndarray:
    """``[L, N, E]`` bool: rank ``p // (P/E)`` holds logical ``p2l[l, p]`` (both engines' layout)."""
    p2l = np.asarray(p2l, dtype=np.int64)
    L, P = p2l.shape
    N = int(num_experts) if num_experts is not None else int(p2l.max()) + 1
    held = np.zeros((L, N, ep_size), bool)
    held[np.arange(L)[:, None], p2l, (np.arange(P) // (P // ep_size))[None, :]] = True
    return held


def load_placement_file(path: str | os.PathLike, ep_size: int, *, dense_layers: int = 0,
                        num_experts: int | None = None) -> PlacementFile:
    """Read an SGLang ``--init-expert-location`` JSON/.pt or a vLLM ``eplb_initial_mapping`` JSON.

    ``ep_size`` is not in either file (the engines take it from their launch flags);
    ``dense_layers`` leading SGLang rows (non-MoE model layers) are dropped.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise PlacementError(f"placement file not found: {path}")
    if path.endswith(".pt"):
        try:
            data = _torch_load(path, "expected an SGLang --init-expert-location .pt file (physical_to_logical_map)")
        except TraceError as exc:
            raise PlacementError(str(exc)) from None
    else:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise PlacementError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PlacementError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if "physical_to_logical_map" in data:
        extra = sorted(set(data) - {"physical_to_logical_map"})
        if extra:
            raise PlacementError(f"{path}: SGLang passes every key to init_by_mapping; unexpected {extra}")
        raw = data["physical_to_logical_map"]
        try:
            p2l = np.asarray(raw.numpy() if hasattr(raw, "numpy") else raw)
        except Exception:
            raise PlacementError(f"{path}: physical_to_logical_map is not a rectangular array") from None
        if p2l.ndim == 2:
            if dense_layers >= p2l.shape[0]:
                raise PlacementError(f"{path}: {p2l.shape[0]} layers, cannot drop {dense_layers} dense ones")
            p2l = p2l[dense_layers:]
        fmt = "sglang"
    elif data.get("record_type") == VLLM_EPLB_RECORD:
        if data.get("version") != 1:
            raise PlacementError(f"{path}: eplb_initial_mapping version {data.get('version')!r}, expected 1")
        assignments = data.get("initial_global_assignments")
        if not isinstance(assignments, dict) or not assignments:
            raise PlacementError(f"{path}: initial_global_assignments must be a non-empty object")
        keys = sorted(assignments, key=lambda k: int(k) if str(k).isdigit() else -1)
        if [str(k) for k in keys] != [str(i) for i in range(len(keys))]:
            raise PlacementError(f"{path}: initial_global_assignments keys must be layers 0..{len(keys) - 1}")
        rows = [assignments[k] for k in keys]
        if len({len(r) for r in rows}) != 1:
            raise PlacementError(f"{path}: layers have different slot counts")
        p2l = np.asarray(rows)
        if data.get("num_slots") != p2l.shape[1]:
            raise PlacementError(f"{path}: num_slots {data.get('num_slots')} but {p2l.shape[1]} slots per layer")
        fmt = "vllm-eplb"
    else:
        raise PlacementError(f"{path}: neither SGLang's physical_to_logical_map nor a vLLM "
                             f"'{VLLM_EPLB_RECORD}' record (keys: {sorted(data)[:6]})")
    p2l, N, R = check_physical_to_logical(p2l, ep_size, num_experts)
    if fmt == "vllm-eplb" and data.get("num_redundant_experts") != R * ep_size:
        raise PlacementError(f"{path}: num_redundant_experts {data.get('num_redundant_experts')} but "
                             f"{p2l.shape[1]} slots - {N} experts = {R * ep_size}")
    return PlacementFile(p2l=p2l, ep_size=int(ep_size), num_experts=N, redundant=R, fmt=fmt)
