"""Durable routing capture: an append-only on-disk layout that survives a killed engine.

A capture requested at ``X.npz`` is written while the engine runs into the directory
``X.npz.parts/``, one *segment* file per engine (``dp<rank>.seg``; only TP rank 0 of an engine
writes). A segment is a sequence of framed records::

    b"SMRC" | uint32 kind | uint64 payload length | uint32 crc32(payload) | payload (.npz bytes)

Record 0 (``kind`` 0, the header) holds the capture's shape: ``num_layers``, ``num_experts``,
``top_k``, ``vocab_size``, ``dp_rank``, ``dp_size`` (int64 scalars) and ``vocab`` (str ``[V]``,
may be empty). Every later record (``kind`` 1) is a chunk of forward steps:

==============  =============  ====================================================
key             dtype, shape   meaning
==============  =============  ====================================================
``names``       str ``[Rc]``   the engine's request ids seen in the chunk
``prompt_len``  int64 ``[Rc]`` their prompt lengths
``request``     int64 ``[n]``  each token's index into ``names``
``position``    int64 ``[n]``  each token's position in its request
``token``       int64 ``[n]``  token ids
``experts``     int ``[n,L,K]`` logical expert ids per MoE layer
==============  =============  ====================================================

A record is appended with one ``write`` and flushed to the OS at once, so a killed process
(``SIGTERM``, ``SIGINT``, ``kill -9``, a crash) leaves every record but at most a torn last one,
which readers drop. :func:`read_capture` merges every segment into one
:class:`~vllm_semmoe.trace.RoutingTrace` (requests of all DP ranks, token order, a recomputed
position keeping its last capture); :func:`vllm_semmoe.trace.load_trace` reads ``X.npz`` or
``X.npz.parts/`` alike, and :func:`compact_capture` turns the parts into the single ``X.npz``.

Pure NumPy: nothing here imports vLLM.
"""

from __future__ import annotations

import glob
import io
import os
import re
import shutil
import struct
import zlib

import numpy as np

from .trace import RoutingTrace, TraceError

MAGIC = b"SMRC"
_FRAME = struct.Struct("<4sIQI")  # magic, kind, payload length, crc32
HEADER, CHUNK = 0, 1
PARTS_SUFFIX = ".parts"
HEADER_KEYS = ("num_layers", "num_experts", "top_k", "vocab_size", "dp_rank", "dp_size")
CHUNK_KEYS = ("names", "prompt_len", "request", "position", "token", "experts")
#: largest record a reader accepts (a corrupt length field must not allocate terabytes)
MAX_RECORD_BYTES = 1 << 34


def parts_dir(path: str | os.PathLike) -> str:
    """The directory a capture at ``path`` is written into while the engine runs."""
    return os.fspath(path) + PARTS_SUFFIX


def segment_path(path: str | os.PathLike, dp_rank: int) -> str:
    """The segment file of DP rank ``dp_rank`` for a capture at ``path``."""
    return os.path.join(parts_dir(path), f"dp{int(dp_rank)}.seg")


# ---- writing ------------------------------------------------------------------------------------
def _frame(kind: int, arrays: dict) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    payload = buffer.getvalue()
    return _FRAME.pack(MAGIC, kind, len(payload), zlib.crc32(payload)) + payload


class SegmentWriter:
    """Appends one engine's routing to its segment file (not thread-safe: the caller locks).

    Opening truncates a stale segment of the same rank; DP rank 0 also removes a stale
    compacted ``X.npz`` and the segments of ranks beyond ``dp_size`` left by an earlier run.
    """

    def __init__(self, path: str | os.PathLike, *, num_layers: int, num_experts: int, top_k: int,
                 vocab_size: int, vocab=(), dp_rank: int = 0, dp_size: int = 1):
        path = os.fspath(path)
        os.makedirs(parts_dir(path), exist_ok=True)
        if dp_rank == 0:
            if os.path.isfile(path):
                os.remove(path)
            for stale in glob.glob(os.path.join(parts_dir(path), "dp*.seg")):
                match = re.fullmatch(r"dp(\d+)\.seg", os.path.basename(stale))
                if match and int(match.group(1)) >= dp_size:
                    os.remove(stale)
        self.path = segment_path(path, dp_rank)
        self.records = 0
        self._file = open(self.path, "wb")
        header = {k: np.int64(v) for k, v in zip(HEADER_KEYS, (num_layers, num_experts, top_k, vocab_size,
                                                               dp_rank, dp_size))}
        header["vocab"] = np.asarray(list(vocab), dtype=str)
        self._write(HEADER, header)

    def append(self, names: list[str], prompt_len, request, position, token, experts) -> None:
        """Append one chunk of steps (shapes as in the module docstring)."""
        self._write(CHUNK, {"names": np.asarray(names, dtype=str), "prompt_len": np.asarray(prompt_len, np.int64),
                            "request": np.asarray(request, np.int64), "position": np.asarray(position, np.int64),
                            "token": np.asarray(token, np.int64), "experts": np.asarray(experts)})

    def _write(self, kind: int, arrays: dict) -> None:
        self._file.write(_frame(kind, arrays))
        self._file.flush()  # in the OS from here: survives the death of this process
        self.records += 1

    def close(self) -> None:
        self._file.close()


# ---- reading ------------------------------------------------------------------------------------
def read_segment(path: str) -> tuple[dict, list[dict], bool]:
    """``(header, chunks, torn)`` of one segment file; ``torn``: a partial last record was dropped.

    Raises :class:`TraceError` naming the file for anything but a torn tail.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read capture segment ({exc})") from None
    records, offset, torn = [], 0, False
    while offset < len(data):
        if len(data) - offset < _FRAME.size:
            torn = True
            break
        magic, kind, length, crc = _FRAME.unpack_from(data, offset)
        if magic != MAGIC:
            raise TraceError(f"{path}: not a semmoe capture segment (bad record marker at byte {offset})")
        if length > MAX_RECORD_BYTES:
            raise TraceError(f"{path}: corrupt record length {length} at byte {offset}")
        start = offset + _FRAME.size
        if start + length > len(data):
            torn = True
            break
        payload = data[start : start + length]
        if zlib.crc32(payload) != crc:
            if start + length == len(data):  # last record damaged while being written
                torn = True
                break
            raise TraceError(f"{path}: record at byte {offset} is corrupt (checksum mismatch)")
        records.append((kind, offset, payload))
        offset = start + length
    if not records:
        raise TraceError(f"{path}: empty capture segment (no header record)")
    header = _parse(path, records[0], HEADER, HEADER_KEYS + ("vocab",))
    header = {k: (_scalar(path, k, header[k]) if k in HEADER_KEYS else header[k]) for k in header}
    chunks = [_parse(path, record, CHUNK, CHUNK_KEYS) for record in records[1:]]
    return header, chunks, torn


def _parse(path: str, record, kind: int, keys: tuple) -> dict:
    got_kind, offset, payload = record
    if got_kind != kind:
        raise TraceError(f"{path}: record at byte {offset} has kind {got_kind}, expected {kind}")
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as exc:  # any decoding failure of untrusted bytes is a damaged file
        raise TraceError(f"{path}: record at byte {offset} is not readable ({type(exc).__name__}: {exc})") from None
    missing = [k for k in keys if k not in arrays]
    if missing:
        raise TraceError(f"{path}: record at byte {offset} lacks field(s) {', '.join(missing)}")
    return arrays


def _scalar(path: str, key: str, value: np.ndarray) -> int:
    if value.shape != () or not np.issubdtype(value.dtype, np.integer) or int(value) < 0:
        raise TraceError(f"{path}: header field {key} must be an integer scalar >= 0, got {value!r}")
    return int(value)


def segment_files(directory: str) -> list[str]:
    """Segment files of a parts directory in DP-rank order."""
    found = []
    for name in os.listdir(directory):
        match = re.fullmatch(r"dp(\d+)\.seg", name)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, name)))
    return [p for _, p in sorted(found)]


def read_capture(directory: str | os.PathLike) -> RoutingTrace:
    """Merge the segments of a parts directory into one :class:`RoutingTrace`.

    Requests are numbered by first appearance (DP rank 0's first); a request's tokens are in
    position order, and a position captured twice (recomputed after preemption) keeps its last
    capture. Raises :class:`TraceError` naming the file for any damage but a torn last record.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise TraceError(f"capture directory not found: {directory}")
    files = segment_files(directory)
    if not files:
        raise TraceError(f"{directory}: no capture segments (dp<rank>.seg); is this a semmoe capture?")
    shape = None
    vocab = None
    keys: dict[tuple[int, str], int] = {}
    prompt_len: list[int] = []
    names: list[str] = []
    columns = {"request": [], "position": [], "token": [], "experts": []}
    for path in files:
        header, chunks, _ = read_segment(path)
        this = tuple(header[k] for k in ("num_layers", "num_experts", "top_k", "vocab_size"))
        if shape is None:
            shape = this
        elif this != shape:
            raise TraceError(f"{path}: segment is for layers/experts/top_k/vocab {this}, others for {shape}")
        if vocab is None and len(header["vocab"]):
            vocab = header["vocab"]
        L, N, K, _ = shape
        rank = header["dp_rank"]
        for chunk in chunks:
            _check_chunk(path, chunk, L, N, K)
            local = np.empty(len(chunk["names"]), np.int64)
            for i, (name, plen) in enumerate(zip(chunk["names"].tolist(), chunk["prompt_len"].tolist())):
                key = (rank, name)
                if key not in keys:
                    keys[key] = len(names)
                    names.append(name)
                    prompt_len.append(0)
                local[i] = keys[key]
                prompt_len[local[i]] = int(plen)
            columns["request"].append(local[chunk["request"]])
            for k in ("position", "token", "experts"):
                columns[k].append(chunk[k])
    if not names:
        raise TraceError(f"{directory}: the capture holds no forward steps yet")
    L, N, K, vocab_size = shape
    req = np.concatenate(columns["request"])
    pos = np.concatenate(columns["position"])
    tok = np.concatenate(columns["token"])
    experts = np.concatenate([e.astype(np.int64) for e in columns["experts"]])
    return assemble_trace(req, pos, tok, experts, names, np.asarray(prompt_len, np.int64),
                          num_experts=N, vocab_size=vocab_size, vocab=vocab, where=directory)


def _check_chunk(path: str, chunk: dict, L: int, N: int, K: int) -> None:
    n = len(chunk["token"])
    R = len(chunk["names"])
    problems = []
    for key in ("request", "position", "token"):
        if chunk[key].shape != (n,) or not np.issubdtype(chunk[key].dtype, np.integer):
            problems.append(f"{key} must be integer [{n}], got {chunk[key].dtype} {chunk[key].shape}")
    if chunk["names"].ndim != 1 or chunk["names"].dtype.kind != "U":
        problems.append(f"names must be a string vector, got {chunk['names'].dtype} {chunk['names'].shape}")
    if chunk["prompt_len"].shape != (R,) or not np.issubdtype(chunk["prompt_len"].dtype, np.integer):
        problems.append(f"prompt_len must be integer [{R}]")
    e = chunk["experts"]
    if e.shape != (n, L, K) or not np.issubdtype(e.dtype, np.integer):
        problems.append(f"experts must be integer [{n}, {L}, {K}], got {e.dtype} {e.shape}")
    if not problems and n:
        if chunk["request"].min() < 0 or chunk["request"].max() >= R:
            problems.append(f"request index outside [0, {R})")
        if chunk["position"].min() < 0:
            problems.append("negative position")
        if e.min() < 0 or e.max() >= N:
            problems.append(f"expert id outside [0, {N})")
    if problems:
        raise TraceError(f"{path}: damaged chunk: " + "; ".join(problems))


def assemble_trace(req, pos, tok, experts, names, prompt_len, *, num_experts: int, vocab_size: int,
                   vocab=None, where: str = "capture") -> RoutingTrace:
    """Per-request trace from captured token rows.

    Args:
        req, pos, tok: ``[n]`` int64 request index (into ``names``), position, token id of each
            captured row, in capture order; experts: ``[n, L, K]`` logical expert ids.
        names: request ids; prompt_len: ``[R]`` their prompt lengths (rows at or past it are decode).
    """
    order = np.lexsort((np.arange(len(req)), pos, req))
    req, pos, tok, experts = req[order], pos[order], tok[order], experts[order]
    keep = np.ones(len(req), bool)
    keep[:-1] = (req[1:] != req[:-1]) | (pos[1:] != pos[:-1])
    req, pos, tok, experts = req[keep], pos[keep], tok[keep], experts[keep]
    counts = np.bincount(req, minlength=len(names))
    present = np.nonzero(counts)[0]
    offsets = np.concatenate([[0], np.cumsum(counts[present])])
    is_decode = pos >= np.asarray(prompt_len)[req]
    experts = np.sort(experts, axis=2)
    dtype = np.uint8 if num_experts <= 256 else np.int16
    if vocab is not None and len(vocab) != vocab_size:
        vocab = None
    try:
        return RoutingTrace.from_arrays(
            tok.astype(np.int32), experts.astype(dtype), offsets, vocab=vocab, vocab_size=vocab_size,
            num_experts=num_experts, request_ids=[request_number(names[r], r) for r in present],
            is_decode=is_decode,
        )
    except TraceError as exc:
        raise TraceError(f"{where}: {exc}") from None


def request_number(name: str, fallback: int) -> int:
    """vLLM request ids look like ``"12"`` or ``"12-9f3a"`` (offline) or ``"cmpl-…"`` (server)."""
    match = re.match(r"(\d+)", name)
    number = int(match.group(1)) if match else fallback
    return number if number < 2**31 else fallback


def compact_capture(path: str | os.PathLike) -> RoutingTrace:
    """Merge ``X.npz.parts/`` into the single file ``X.npz`` (written atomically), then remove
    the parts. Call it once every engine writing the capture has stopped."""
    path = os.fspath(path)
    trace = read_capture(parts_dir(path))
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        trace.save(f)
    os.replace(tmp, path)
    shutil.rmtree(parts_dir(path))
    return trace
