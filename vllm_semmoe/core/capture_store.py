"""Durable routing capture: an append-only on-disk layout that survives a killed engine.

A capture requested at ``X.npz`` is written while the engine runs into the directory
``X.npz.parts/``, one *segment* file per engine (``dp<rank>.seg``; only TP rank 0 of an engine
writes). A segment is a sequence of framed records::

    b"SMRC" | uint32 kind | uint64 payload length | uint32 crc32(payload) | payload

Record 0 (``kind`` 0, the header, an ``.npz`` payload) holds the capture's shape:
``num_layers``, ``num_experts``, ``top_k``, ``vocab_size``, ``dp_rank``, ``dp_size`` (int64
scalars), ``vocab`` (str ``[V]``, may be empty) and ``format_version`` (int64; absent in the
first format, which is version 1). Every later record of ``kind`` 1 is one forward step, in a
compact little-endian payload (``Rs`` requests, ``n`` tokens)::

    uint32 Rs | uint32 n | uint16 L | uint16 K | uint8 expert bytes (1, 2 or 4) | 3 pad bytes
    uint32 name bytes | the step's request ids, UTF-8, NUL-separated
    int64 [Rs] prompt lengths | int32 [n] request index (into the step's ids)
    int32 [n] position | int32 [n] token id | uint{8,16,32} [n, L, K] logical expert ids

Version 2 records coverage: a record of ``kind`` 2, written together with the step record that
follows it, lists the tokens of that step's requests whose routing the engine did not compute
(positions before the step that no earlier step computed: a prefix-cache hit, KV loaded from
elsewhere)::

    uint32 u | int32 [u] request index (into the next step's ids) | int32 [u] position | int32 [u] token id

A version-2 capture therefore holds every token its requests had, routed or not
(:attr:`~vllm_semmoe.core.trace.RoutingTrace.unrouted`, :func:`coverage`); a version-1 capture says
nothing about the tokens it lacks.

Engines append a step's record as soon as its forward pass ends, with one ``write`` flushed to
the OS at once, so a killed process (``SIGTERM``, ``SIGINT``, ``kill -9``, a crash) loses at
most the step it was computing: every request a client saw complete is on disk. A torn last
record is dropped by readers. :func:`read_capture` merges every segment into one
:class:`~vllm_semmoe.core.trace.RoutingTrace` (requests of all DP ranks, token order, a recomputed
position keeping its last capture); :func:`load_trace` reads ``X.npz`` or
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

from .trace import RoutingTrace, TraceError, read_trace_npz

MAGIC = b"SMRC"
_FRAME = struct.Struct("<4sIQI")  # magic, kind, payload length, crc32
HEADER, CHUNK, UNROUTED = 0, 1, 2
#: the segment format this module writes (1: no ``format_version`` key, no coverage records)
FORMAT_VERSION = 2
PARTS_SUFFIX = ".parts"
HEADER_KEYS = ("num_layers", "num_experts", "top_k", "vocab_size", "dp_rank", "dp_size")
_STEP = struct.Struct("<IIHHB3xI")  # requests, tokens, layers, top_k, expert bytes, name bytes
_EXPERT_TYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}
#: largest record a reader accepts (a corrupt length field must not allocate terabytes)
MAX_RECORD_BYTES = 1 << 34


def parts_dir(path: str | os.PathLike) -> str:
    """The directory a capture at ``path`` is written into while the engine runs."""
    return os.fspath(path) + PARTS_SUFFIX


def segment_path(path: str | os.PathLike, dp_rank: int) -> str:
    """The segment file of DP rank ``dp_rank`` for a capture at ``path``."""
    return os.path.join(parts_dir(path), f"dp{int(dp_rank)}.seg")


# ---- writing ------------------------------------------------------------------------------------
def _frame(kind: int, payload: bytes) -> bytes:
    return _FRAME.pack(MAGIC, kind, len(payload), zlib.crc32(payload)) + payload


def _npz_bytes(arrays: dict) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def encode_step(names, prompt_len, request, position, token, experts) -> bytes:
    """The payload of one step record (layout in the module docstring)."""
    experts = np.asarray(experts)
    n, L, K = experts.shape
    top = int(experts.max()) if n else 0
    width = 1 if top < 256 else 2 if top < 65536 else 4
    blob = "\0".join(names).encode()
    return b"".join((
        _STEP.pack(len(names), n, L, K, width, len(blob)), blob,
        np.asarray(prompt_len, "<i8").tobytes(), np.asarray(request, "<i4").tobytes(),
        np.asarray(position, "<i4").tobytes(), np.asarray(token, "<i4").tobytes(),
        experts.astype(np.dtype(_EXPERT_TYPES[width]).newbyteorder("<")).tobytes(),
    ))


def encode_unrouted(request, position, token) -> bytes:
    """The payload of a coverage record (layout in the module docstring)."""
    request = np.asarray(request, "<i4")
    return b"".join((struct.pack("<I", len(request)), request.tobytes(), np.asarray(position, "<i4").tobytes(),
                     np.asarray(token, "<i4").tobytes()))


def decode_unrouted(payload: bytes) -> dict:
    """Inverse of :func:`encode_unrouted`; ``ValueError`` on a payload of the wrong size."""
    if len(payload) < 4:
        raise ValueError(f"{len(payload)} bytes, shorter than a coverage record header")
    (u,) = struct.unpack_from("<I", payload)
    if 4 + 12 * u != len(payload):
        raise ValueError(f"{len(payload)} bytes do not match its header ({u} tokens)")
    columns = [np.frombuffer(payload, "<i4", u, 4 + 4 * u * i).astype(np.int64) for i in range(3)]
    return dict(zip(("request", "position", "token"), columns))


def decode_step(payload: bytes) -> dict:
    """Inverse of :func:`encode_step`; ``ValueError`` on a payload of the wrong size."""
    if len(payload) < _STEP.size:
        raise ValueError(f"{len(payload)} bytes, shorter than a step header")
    R, n, L, K, width, name_bytes = _STEP.unpack_from(payload)
    if width not in _EXPERT_TYPES:
        raise ValueError(f"expert width {width}")
    sizes = (name_bytes, 8 * R, 4 * n, 4 * n, 4 * n, width * n * L * K)
    if _STEP.size + sum(sizes) != len(payload):
        raise ValueError(f"{len(payload)} bytes do not match its header ({R} requests, {n} tokens, {L}x{K})")
    offset = _STEP.size
    parts = []
    for size in sizes:
        parts.append(payload[offset : offset + size])
        offset += size
    names = parts[0].decode().split("\0") if R else []
    if len(names) != R:
        raise ValueError(f"{len(names)} request ids for {R} requests")
    return {
        "names": names,
        "prompt_len": np.frombuffer(parts[1], "<i8").astype(np.int64),
        "request": np.frombuffer(parts[2], "<i4").astype(np.int64),
        "position": np.frombuffer(parts[3], "<i4").astype(np.int64),
        "token": np.frombuffer(parts[4], "<i4").astype(np.int64),
        "experts": np.frombuffer(parts[5], np.dtype(_EXPERT_TYPES[width]).newbyteorder("<")).reshape(n, L, K),
    }


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
        header["format_version"] = np.int64(FORMAT_VERSION)
        self._file.write(_frame(HEADER, _npz_bytes(header)))
        self._file.flush()
        self.records = 1

    def append(self, names: list[str], prompt_len, request, position, token, experts, unrouted=None) -> None:
        """Append one forward step: ``names`` the step's request ids, ``prompt_len`` ``[Rs]``,
        ``request``/``position``/``token`` ``[n]``, ``experts`` ``[n, L, K]`` logical ids;
        ``unrouted``: ``(request, position, token)`` ``[u]`` each, tokens of the step's requests
        whose routing was not computed (written in the same ``write``, before the step)."""
        frames = [_frame(CHUNK, encode_step(names, prompt_len, request, position, token, experts))]
        if unrouted is not None and len(unrouted[0]):
            frames.insert(0, _frame(UNROUTED, encode_unrouted(*unrouted)))
        self._file.write(b"".join(frames))
        self._file.flush()  # in the OS from here: survives the death of this process
        self.records += len(frames)

    def close(self) -> None:
        self._file.close()


# ---- reading ------------------------------------------------------------------------------------
def read_segment(path: str) -> tuple[dict, list[dict], bool]:
    """``(header, steps, torn)`` of one segment file; ``torn``: a partial last record was dropped
    (``header`` is ``None`` when not even the header record is complete). A step whose coverage
    record precedes it carries it as ``step["unrouted"]`` (``request``, ``position``, ``token``).

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
    if not records:  # killed before its header was complete: nothing captured
        return None, [], True
    header = _parse_header(path, records[0])
    chunks, unrouted = [], None
    for record in records[1:]:
        if record[0] == UNROUTED and header["format_version"] >= 2:
            unrouted = _parse_unrouted(path, record)
            continue
        chunks.append(_parse_step(path, record))
        if unrouted is not None:
            if len(unrouted["request"]) and unrouted["request"].max() >= len(chunks[-1]["names"]):
                raise TraceError(f"{path}: coverage record before byte {record[1]} names a request the step lacks")
            chunks[-1]["unrouted"], unrouted = unrouted, None
    return header, chunks, torn


def _parse_header(path: str, record) -> dict:
    kind, offset, payload = record
    if kind != HEADER:
        raise TraceError(f"{path}: first record has kind {kind}, expected a header ({HEADER})")
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as exc:  # any decoding failure of untrusted bytes is a damaged file
        raise TraceError(f"{path}: header record is not readable ({type(exc).__name__}: {exc})") from None
    missing = [k for k in HEADER_KEYS + ("vocab",) if k not in arrays]
    if missing:
        raise TraceError(f"{path}: header record lacks field(s) {', '.join(missing)}")
    header = {k: _scalar(path, k, arrays[k]) for k in HEADER_KEYS}
    header["format_version"] = _scalar(path, "format_version", arrays["format_version"]) \
        if "format_version" in arrays else 1
    if header["format_version"] > FORMAT_VERSION:
        raise TraceError(f"{path}: capture format version {header['format_version']} is newer than this "
                         f"vllm-semmoe reads ({FORMAT_VERSION}); upgrade vllm-semmoe")
    vocab = arrays["vocab"]
    if vocab.ndim != 1 or vocab.dtype.kind not in "US":
        raise TraceError(f"{path}: header vocab must be a 1-D string array, got {vocab.dtype} {vocab.shape}")
    header["vocab"] = vocab
    return header


def _parse_step(path: str, record) -> dict:
    kind, offset, payload = record
    if kind != CHUNK:
        raise TraceError(f"{path}: record at byte {offset} has kind {kind}, expected a step ({CHUNK})")
    try:
        return decode_step(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: step record at byte {offset} is damaged ({exc})") from None


def _parse_unrouted(path: str, record) -> dict:
    kind, offset, payload = record
    try:
        rows = decode_unrouted(payload)
    except ValueError as exc:
        raise TraceError(f"{path}: coverage record at byte {offset} is damaged ({exc})") from None
    if len(rows["request"]) and min(int(rows[k].min()) for k in rows) < 0:
        raise TraceError(f"{path}: coverage record at byte {offset} is damaged (negative index, position or token)")
    return rows


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
    unrouted: list[np.ndarray] | None = []  # None: a segment of the first format (coverage unknown)
    for path in files:
        header, chunks, _ = read_segment(path)
        if header is None:
            continue
        if header["format_version"] < 2:
            unrouted = None
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
            for i, (name, plen) in enumerate(zip(chunk["names"], chunk["prompt_len"].tolist())):
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
            if unrouted is not None and "unrouted" in chunk:
                gap = chunk["unrouted"]
                unrouted.append(np.column_stack([local[gap["request"]], gap["position"], gap["token"]]))
    if not names:
        raise TraceError(f"{directory}: the capture holds no forward steps yet")
    L, N, K, vocab_size = shape
    req = np.concatenate(columns["request"])
    pos = np.concatenate(columns["position"])
    tok = np.concatenate(columns["token"])
    experts = np.concatenate([e.astype(np.int64) for e in columns["experts"]])
    if unrouted is not None:
        unrouted = np.concatenate(unrouted) if unrouted else np.zeros((0, 3), np.int64)
    return assemble_trace(req, pos, tok, experts, names, np.asarray(prompt_len, np.int64),
                          num_experts=N, vocab_size=vocab_size, vocab=vocab, where=directory, unrouted=unrouted)


def _check_chunk(path: str, chunk: dict, L: int, N: int, K: int) -> None:
    n, R = len(chunk["token"]), len(chunk["names"])
    e = chunk["experts"]
    problems = []
    if e.shape[1:] != (L, K):
        problems.append(f"experts are [n, {e.shape[1]}, {e.shape[2]}], the header says [n, {L}, {K}]")
    elif n:
        if chunk["request"].min() < 0 or chunk["request"].max() >= R:
            problems.append(f"request index outside [0, {R})")
        if chunk["position"].min() < 0 or chunk["token"].min() < 0:
            problems.append("negative position or token id")
        if e.max() >= N:
            problems.append(f"expert id {int(e.max())} >= {N} experts")
    if problems:
        raise TraceError(f"{path}: damaged step record: " + "; ".join(problems))


def assemble_trace(req, pos, tok, experts, names, prompt_len, *, num_experts: int, vocab_size: int,
                   vocab=None, where: str = "capture", unrouted=None) -> RoutingTrace:
    """Per-request trace from captured token rows.

    Args:
        req, pos, tok: ``[n]`` int64 request index (into ``names``), position, token id of each
            captured row, in capture order; experts: ``[n, L, K]`` logical expert ids.
        names: request ids; prompt_len: ``[R]`` their prompt lengths (rows at or past it are decode).
        unrouted: ``[u, 3]`` (request index into ``names``, position, token id) of tokens recorded
            without routing (``None``: coverage not recorded). A position some row captured
            after all (recomputed later) counts as routed; requests with no routed row are dropped.
    """
    if unrouted is not None:
        unrouted = _unrouted_rows(np.asarray(unrouted, np.int64).reshape(-1, 3), req, pos, len(names))
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
    if unrouted is not None:  # request index -> its place among the present requests
        place = np.full(len(names), -1, np.int64)
        place[present] = np.arange(len(present))
        unrouted = unrouted[place[unrouted[:, 0]] >= 0]
        unrouted[:, 0] = place[unrouted[:, 0]]
    try:
        return RoutingTrace.from_arrays(
            tok.astype(np.int32), experts.astype(dtype), offsets, vocab=vocab, vocab_size=vocab_size,
            num_experts=num_experts, request_ids=[request_number(names[r], r) for r in present],
            is_decode=is_decode, unrouted=unrouted,
        )
    except TraceError as exc:
        raise TraceError(f"{where}: {exc}") from None


def _unrouted_rows(unrouted: np.ndarray, req: np.ndarray, pos: np.ndarray, num_requests: int) -> np.ndarray:
    """``unrouted`` without duplicates and without the positions a captured row covers, sorted by
    (request, position)."""
    if not len(unrouted):
        return unrouted
    span = int(max(pos.max(initial=0), unrouted[:, 1].max())) + 1
    key = unrouted[:, 0] * span + unrouted[:, 1]
    _, first = np.unique(key, return_index=True)
    unrouted, key = unrouted[first], key[first]  # sorted by (request, position)
    return unrouted[~np.isin(key, req * span + pos)]


def coverage(trace: RoutingTrace) -> dict | None:
    """How many of the tokens a captured trace's requests had carry routing: ``{"routed_tokens",
    "unrouted_tokens", "routed_share", "requests_with_unrouted"}``; ``None`` when the trace does
    not record it (not a live capture, or one of the first capture format)."""
    if trace.unrouted is None:
        return None
    unrouted = len(trace.unrouted)
    return {"routed_tokens": trace.num_tokens, "unrouted_tokens": unrouted,
            "routed_share": trace.num_tokens / (trace.num_tokens + unrouted),
            "requests_with_unrouted": int(len(np.unique(trace.unrouted[:, 0])))}


def coverage_text(trace: RoutingTrace) -> str:
    """One phrase stating a trace's routing coverage (:func:`coverage`)."""
    cover = coverage(trace)
    if cover is None:
        return "coverage not recorded"
    if not cover["unrouted_tokens"]:
        return f"routing for all {cover['routed_tokens']} tokens"
    return (f"routing for {cover['routed_share']:.1%} of tokens ({cover['unrouted_tokens']} of "
            f"{cover['routed_tokens'] + cover['unrouted_tokens']} in {cover['requests_with_unrouted']} requests "
            f"not computed: prefix-cache hits or KV loaded from elsewhere)")


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


def load_trace(path: str | os.PathLike) -> RoutingTrace:
    """Load and validate a routing trace; :class:`TraceError` (naming the file) on anything malformed.

    ``path`` is a trace ``.npz`` (:func:`.trace.read_trace_npz`), or a live capture: ``X.npz`` whose
    ``X.npz.parts/`` directory running or stopped engines wrote, or that directory.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return read_capture(path)
    parts = path + PARTS_SUFFIX
    if not os.path.exists(path):
        if os.path.isdir(parts):
            return read_capture(parts)
        raise TraceError(f"trace file not found: {path}")
    if os.path.isdir(parts):
        raise TraceError(f"both {path} and the capture directory {parts} exist; remove the stale one "
                         f"(the directory is newer if an engine wrote to it after {path} was made)")
    return read_trace_npz(path)


def as_trace(trace) -> RoutingTrace:
    """``trace`` itself if it is a :class:`RoutingTrace`, else :func:`load_trace` of the path."""
    return trace if isinstance(trace, RoutingTrace) else load_trace(trace)
