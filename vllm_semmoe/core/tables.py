"""Sem-MoE lookup tables: what the online scheduler needs, built once offline.

Per MoE layer ``l`` (E = EP size):

- **E2D** ``placement.expert_device[l]``: expert → device.
- **T2D** ``t2d_score[l, j, :]``: for profiled token ``t2d_tokens[j]``, the share of its
  activations that would be local on each device (a device ranking). ``t2d_device`` is the
  argmax, ``t2d_confidence`` the max. Unseen tokens use the out-of-vocabulary default
  ``oov_score[l]`` (the layer's overall device share). In ``dp`` tables each row is weighted by
  the token's inverse document frequency over the profiled requests (:func:`request_idf`), so
  a request's summed votes favour its topical tokens.
- **A** ``markov[l, d2 * E + d1, :]``: the same share, predicted from the devices that held most
  of the token's experts at layers ``l-2`` (``d2``) and ``l-1`` (``d1``) — the paper's
  device-sequence Markov table (``[E^2, E]``); rows for ``l < 2`` are unused.
- **X** ``transition[l, j - 1, n, m]`` (``j`` = 1, 2): the probability that an activation at
  layer ``l`` goes to logical expert ``m`` given that the token activated expert ``n`` at layer
  ``l - j``, and ``expert_prior[l, m]`` the layer's share of activations of ``m``. A token's
  experts at the previous layers are known when the shuffle of layer ``l`` is decided (they were
  routed), and they are sharper evidence than the A table's two majority devices: the scheduler
  (:func:`.scheduling.tp_expert_scores`) combines them with T2D. In logical expert space, so
  the same for any placement; rows for ``l < j`` are unused.

Scores are smoothed towards the layer prior with ``alpha`` pseudo-occurrences so that tokens
seen once do not claim full confidence. Tables save to a directory with a JSON manifest.

With replication (``placement.redundant = R > 0``) an expert may be held by several devices;
"local on device ``e``" then means "``e`` holds a copy", so a token's shares over devices can
sum to more than 1, and every table (and :func:`placement_device_counts`) counts copies.
Format ``vllm-semmoe-tables/2`` adds ``redundant`` to the manifest and the ``replicas`` array;
``/3`` adds ``transition`` and ``expert_prior``. ``/1`` and ``/2`` tables still load (without X
the TP scheduler uses the A table).
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass

import numba
import numpy as np

from .. import __version__
from .affinity import token_expert_counts
from .modes import MODES, ServingMode, serving_mode
from .placement import Placement, PlacementError
from .trace import RoutingTrace

MANIFEST = "manifest.json"
ARRAYS = "tables.npz"
FORMAT = "vllm-semmoe-tables/3"  # /2 adds "redundant" and "replicas"; /3 "transition", "expert_prior"
READABLE_FORMATS = ("vllm-semmoe-tables/1", "vllm-semmoe-tables/2", FORMAT)
#: previous layers whose experts the X table conditions on (``transition[:, j - 1]``: lag ``j``)
TRANSITION_LAGS = 2


class TablesError(ValueError):
    """Tables are missing, malformed, or built for another model shape / EP size."""


@dataclass(frozen=True)
class SemMoETables:
    """Placement plus the T2D / A lookup tables (see module docstring for shapes)."""

    placement: Placement
    t2d_tokens: np.ndarray  # [J] int32, ascending
    t2d_score: np.ndarray  # [L, J, E] float16
    markov: np.ndarray  # [L, E*E, E] float32
    oov_score: np.ndarray  # [L, E] float32
    top_k: int
    vocab_size: int
    mode: str
    source_trace: str
    #: ``[V]`` int32 optional: row used for a token id that was never profiled (its nearest
    #: profiled neighbour in the model's embedding space, :func:`nearest_profiled_rows`);
    #: ``None``: unseen tokens use ``oov_score``
    oov_rows: np.ndarray | None = None
    #: ``[L, TRANSITION_LAGS, N, N]`` float32 optional: the X table (module docstring); ``None``
    #: in tables older than format /3
    transition: np.ndarray | None = None
    #: ``[L, N]`` float32: share of each layer's activations per logical expert (with X)
    expert_prior: np.ndarray | None = None

    def log_evidence(self) -> np.ndarray:
        """``[L, TRANSITION_LAGS, N, N]`` float32 ``log(X / expert_prior)``: what an earlier
        expert ``n`` says about expert ``m`` (:func:`.scheduling.tp_expert_scores`'s input).
        Computed once per tables object."""
        return self._log_x[0]

    def log_expert_prior(self) -> np.ndarray:
        """``[L, N]`` float32 ``log(expert_prior)`` (:func:`.scheduling.tp_expert_scores`'s input)."""
        return self._log_x[1]

    @functools.cached_property
    def _log_x(self) -> tuple[np.ndarray, np.ndarray]:
        if self.transition is None:
            raise TablesError("these tables have no transition (X) table; re-create them with `semmoe solve`")
        floor = 1e-12
        log_prior = np.log(np.maximum(self.expert_prior, floor))
        evidence = np.log(np.maximum(self.transition, floor)) - log_prior[:, None, None, :]
        return evidence.astype(np.float32), log_prior.astype(np.float32)

    @property
    def ep_size(self) -> int:
        return self.placement.ep_size

    @property
    def num_layers(self) -> int:
        return self.placement.num_layers

    @property
    def num_experts(self) -> int:
        return self.placement.num_experts

    @property
    def t2d_device(self) -> np.ndarray:
        """``[L, J]`` int64: T2D's device for each profiled token."""
        return np.argmax(self.t2d_score, axis=2)

    @property
    def t2d_confidence(self) -> np.ndarray:
        """``[L, J]`` float32: T2D's confidence (share local on its device)."""
        return self.t2d_score.max(axis=2).astype(np.float32)

    def token_rows(self, tokens: np.ndarray) -> np.ndarray:
        """``[T]`` int64 row of each token id in ``t2d_score``; for unseen tokens the row of
        their nearest profiled neighbour when ``oov_rows`` is set, else ``-1``."""
        tokens = np.asarray(tokens, np.int64)
        pos = np.searchsorted(self.t2d_tokens, tokens)
        pos = np.minimum(pos, max(len(self.t2d_tokens) - 1, 0))
        found = (len(self.t2d_tokens) > 0) & (self.t2d_tokens[pos] == tokens)
        rows = np.where(found, pos, -1)
        if self.oov_rows is not None:
            known = ~found & (tokens >= 0) & (tokens < len(self.oov_rows))
            rows[known] = self.oov_rows[tokens[known]]
        return rows

    def check_compatible(self, *, num_layers: int, num_experts: int, ep_size: int | None = None) -> None:
        """Raise :class:`TablesError` naming each mismatch with the running model/EP size."""
        problems = []
        if num_layers != self.num_layers:
            problems.append(f"MoE layers {self.num_layers} (model has {num_layers})")
        if num_experts != self.num_experts:
            problems.append(f"experts per layer {self.num_experts} (model has {num_experts})")
        if ep_size is not None and ep_size != self.ep_size:
            problems.append(f"EP size {self.ep_size} (running with {ep_size})")
        if problems:
            raise TablesError("tables were built for another configuration: " + "; ".join(problems))

    # ---- I/O -----------------------------------------------------------------------------
    def manifest(self) -> dict:
        return {
            "format": FORMAT,
            "semmoe_version": __version__,
            "method": self.placement.method,
            "mode": self.mode,
            "ep_size": self.ep_size,
            "redundant": self.placement.redundant,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "vocab_size": self.vocab_size,
            "profiled_tokens": int(len(self.t2d_tokens)),
            "oov": "prior" if self.oov_rows is None else "nearest",
            "source_trace": self.source_trace,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``tables.npz`` and ``manifest.json`` into ``directory`` (created if needed)."""
        os.makedirs(directory, exist_ok=True)
        np.savez_compressed(
            os.path.join(directory, ARRAYS),
            expert_device=self.placement.expert_device,
            replicas=self.placement.replicas,
            t2d_tokens=self.t2d_tokens,
            t2d_score=self.t2d_score,
            markov=self.markov,
            oov_score=self.oov_score,
            **({} if self.oov_rows is None else {"oov_rows": self.oov_rows}),
            **({} if self.transition is None else {"transition": self.transition,
                                                    "expert_prior": self.expert_prior}),
        )
        with open(os.path.join(directory, MANIFEST), "w") as f:
            json.dump(self.manifest(), f, indent=2)
            f.write("\n")


def load_tables(directory: str | os.PathLike, *, num_layers: int | None = None,
                num_experts: int | None = None, ep_size: int | None = None) -> SemMoETables:
    """Load tables saved by :meth:`SemMoETables.save`; :class:`TablesError` naming the file and
    the fix for a missing, damaged or incomplete directory.

    When ``num_layers``/``num_experts`` (and optionally ``ep_size``) are given, tables built
    for another shape raise :class:`TablesError`.
    """
    directory = os.fspath(directory)
    manifest = _read_manifest(directory)
    arrays = _read_arrays(directory)
    if arrays["expert_device"].ndim != 2 or not np.issubdtype(arrays["expert_device"].dtype, np.integer):
        raise TablesError(f"{os.path.join(directory, ARRAYS)}: expert_device must be an integer [L, N] array, got "
                          f"{arrays['expert_device'].dtype} {arrays['expert_device'].shape}; {_RESOLVE}")
    e2d = arrays["expert_device"]
    if e2d.size and e2d.min() >= 0 and int(e2d.max()) + 1 != manifest["ep_size"]:
        raise TablesError(f"{os.path.join(directory, ARRAYS)}: expert_device holds device ids 0..{int(e2d.max())} "
                          f"(EP {int(e2d.max()) + 1}), {os.path.join(directory, MANIFEST)} says ep_size "
                          f"{manifest['ep_size']}; {_RESOLVE}")
    try:
        placement = Placement(e2d, manifest["ep_size"], manifest["method"],
                              arrays["replicas"] if manifest.get("redundant", 0) else None)
    except PlacementError as exc:
        raise TablesError(f"{os.path.join(directory, ARRAYS)}: {exc}; {_RESOLVE}") from None
    L, E = placement.num_layers, placement.ep_size
    arrays_path = os.path.join(directory, ARRAYS)
    if (L, placement.num_experts) != (manifest["num_layers"], manifest["num_experts"]):
        raise TablesError(f"{arrays_path}: expert_device is {L} x {placement.num_experts}, the manifest says "
                          f"{manifest['num_layers']} layers x {manifest['num_experts']} experts; {_RESOLVE}")
    tokens = arrays["t2d_tokens"]
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer) or (len(tokens) and (
            tokens.min() < 0 or np.any(np.diff(tokens) <= 0) or tokens.max() >= manifest["vocab_size"])):
        raise TablesError(f"{arrays_path}: t2d_tokens must be ascending token ids below vocab_size "
                          f"{manifest['vocab_size']}; {_RESOLVE}")
    expected = {
        "t2d_score": (L, len(tokens), E),
        "markov": (L, E * E, E),
        "oov_score": (L, E),
    }
    N = placement.num_experts
    has_x = "transition" in arrays or "expert_prior" in arrays
    if has_x:
        expected.update(transition=(L, TRANSITION_LAGS, N, N), expert_prior=(L, N))
    for key, shape in expected.items():
        if key not in arrays:
            raise TablesError(f"{arrays_path}: has transition or expert_prior but not both; {_RESOLVE}")
        if arrays[key].shape != shape or not np.issubdtype(arrays[key].dtype, np.floating):
            raise TablesError(f"{arrays_path}: {key} is {arrays[key].dtype} {arrays[key].shape}, expected "
                              f"floats of shape {shape}; {_RESOLVE}")
    tables = SemMoETables(
        placement=placement,
        t2d_tokens=tokens.astype(np.int32),
        t2d_score=arrays["t2d_score"],
        markov=arrays["markov"],
        oov_score=arrays["oov_score"],
        top_k=manifest["top_k"],
        vocab_size=manifest["vocab_size"],
        mode=manifest["mode"],
        source_trace=manifest["source_trace"],
        oov_rows=arrays.get("oov_rows"),
        transition=arrays["transition"].astype(np.float32) if has_x else None,
        expert_prior=arrays["expert_prior"].astype(np.float32) if has_x else None,
    )
    if num_layers is not None or num_experts is not None:
        tables.check_compatible(
            num_layers=num_layers if num_layers is not None else L,
            num_experts=num_experts if num_experts is not None else placement.num_experts,
            ep_size=ep_size,
        )
    return tables


_RESOLVE = "re-create the directory with `semmoe solve`"
#: manifest fields and their types (integers must be >= 1)
_MANIFEST_FIELDS = {"format": str, "method": str, "mode": str, "ep_size": int, "num_layers": int,
                    "num_experts": int, "top_k": int, "vocab_size": int, "source_trace": str}
_ARRAY_FIELDS = ("expert_device", "t2d_tokens", "t2d_score", "markov", "oov_score")
_OPTIONAL_ARRAYS = ("replicas", "oov_rows", "transition", "expert_prior")  # /2: replication,
# nearest-neighbour rows; /3: the X table


def _read_manifest(directory: str) -> dict:
    """The validated ``manifest.json`` of a tables directory."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise TablesError(f"tables directory not found: {directory}")
    if not os.path.exists(path):
        raise TablesError(f"{directory}: no {MANIFEST}; is this the output of `semmoe solve`?")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise TablesError(f"{path}: not readable JSON ({exc}); {_RESOLVE}") from None
    if not isinstance(manifest, dict):
        raise TablesError(f"{path}: expected a JSON object, got {type(manifest).__name__}; {_RESOLVE}")
    if manifest.get("format") not in READABLE_FORMATS:
        raise TablesError(f"{path}: unknown format {manifest.get('format')!r} (this version reads "
                          f"{', '.join(READABLE_FORMATS)}); {_RESOLVE}")
    redundant = manifest.get("redundant", 0)
    if not isinstance(redundant, int) or isinstance(redundant, bool) or redundant < 0:
        raise TablesError(f"{path}: field redundant must be an integer >= 0, got {redundant!r}; {_RESOLVE}")
    missing = [k for k in _MANIFEST_FIELDS if k not in manifest]
    if missing:
        raise TablesError(f"{path}: missing field(s) {', '.join(missing)}; {_RESOLVE}")
    for key, kind in _MANIFEST_FIELDS.items():
        value = manifest[key]
        ok = isinstance(value, kind) and not isinstance(value, bool) and (kind is not int or value >= 1)
        if not ok:
            raise TablesError(f"{path}: field {key} must be {'an integer >= 1' if kind is int else 'a string'}, "
                              f"got {value!r}; {_RESOLVE}")
    if manifest["mode"] not in MODES:
        raise TablesError(f"{path}: mode must be one of {', '.join(MODES)}, got {manifest['mode']!r}; {_RESOLVE}")
    return manifest


def _read_arrays(directory: str) -> dict:
    """The arrays of ``tables.npz`` (every field present, no Python objects)."""
    path = os.path.join(directory, ARRAYS)
    if not os.path.exists(path):
        raise TablesError(f"{directory}: no {ARRAYS}; {_RESOLVE}")
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [k for k in _ARRAY_FIELDS if k not in data.files]
            if missing:
                raise TablesError(f"{path}: missing array(s) {', '.join(missing)}; {_RESOLVE}")
            return {k: data[k] for k in _ARRAY_FIELDS + _OPTIONAL_ARRAYS if k in data.files}
    except TablesError:
        raise
    except Exception as exc:  # zipfile/zlib/EOF/pickle/format errors of a damaged file
        raise TablesError(f"{path}: damaged or truncated ({type(exc).__name__}: {exc}); {_RESOLVE}") from None


def build_tables(profile: RoutingTrace, placement: Placement, *, mode: str = ServingMode.TP,
                 alpha: float = 1.0, embedding: np.ndarray | None = None) -> SemMoETables:
    """Derive T2D, A and the OOV default from a profile trace and a placement.

    Args:
        profile: the calibration trace.
        placement: the expert placement the tables describe.
        alpha: smoothing, in pseudo-occurrences of the layer prior.
        embedding: optional ``[V, H]`` input embedding matrix of the model; then a token never
            profiled takes the T2D row of its nearest profiled neighbour (the paper's rule,
            :func:`nearest_profiled_rows`) instead of the layer prior.
    """
    mode = serving_mode(mode)
    if placement.num_layers != profile.num_layers or placement.num_experts != profile.num_experts:
        raise TablesError(
            f"placement is for {placement.num_layers}x{placement.num_experts} experts, "
            f"trace has {profile.num_layers}x{profile.num_experts}"
        )
    K = profile.top_k
    token_ids, counts = token_expert_counts(profile)  # [L, J, N]
    dev_counts = placement_device_counts(profile.experts, placement)  # [T, L, E]
    # the layer prior: share of all activations local on each device (sums to 1 when R = 0)
    prior = dev_counts.sum(axis=0).astype(np.float64) / max(profile.num_tokens * K, 1)  # [L, E]
    # T2D: per token, activations per device, smoothed towards the layer prior
    holds = placement.holds().astype(np.float64)  # [L, N, E]
    per_device = np.einsum("ljn,lne->lje", counts, holds)
    occurrences = counts[0].sum(axis=1) / K  # [J]
    t2d = (per_device / K + alpha * prior[:, None, :]) / (occurrences[None, :, None] + alpha)
    if mode == ServingMode.DP:
        # a DP request's rank is its summed T2D votes (scheduling.request_votes): weight each
        # token's vote by its informativeness, the inverse document frequency over profiled
        # requests, so that the function words every prompt shares do not drown the topical ones
        t2d = t2d * request_idf(profile, token_ids)[None, :, None]
    markov, seen = _markov_counts(dev_counts)  # [L, E*E, E] activations, [L, E*E] tokens
    markov = (markov / K + alpha * prior[:, None, :]) / (seen[:, :, None] + alpha)
    markov[:2] = 0.0
    transition, expert_prior = expert_transitions(profile, alpha)
    return SemMoETables(
        placement=placement,
        t2d_tokens=token_ids,
        t2d_score=t2d.astype(np.float16),
        markov=markov.astype(np.float32),
        oov_score=prior.astype(np.float32),
        top_k=K,
        vocab_size=profile.vocab_size,
        mode=mode,
        source_trace=profile.fingerprint(),
        oov_rows=None if embedding is None else nearest_profiled_rows(embedding, token_ids),
        transition=transition,
        expert_prior=expert_prior,
    )


def request_idf(profile: RoutingTrace, token_ids: np.ndarray) -> np.ndarray:
    """``[J]`` float64 inverse document frequency of ``token_ids`` over the profile's requests,
    ``log((R + 1) / (df + 1)) + 1`` (``df``: requests containing the token; smoothed, at least 1).

    The DP tables weight each token's T2D row by it: on the DeepSeek-V2-Lite trace (seeds 0-4)
    pure-locality DP LAR 0.1697 → 0.1738 (oracle 0.1838); see benchmarks/SEEDS.md."""
    R = profile.num_requests
    request = np.repeat(np.arange(R, dtype=np.int64), np.diff(profile.offsets))
    row = np.searchsorted(token_ids, profile.tokens)
    pairs = np.unique(request * len(token_ids) + row)
    df = np.bincount(pairs % len(token_ids), minlength=len(token_ids))
    return np.log((R + 1.0) / (df + 1.0)) + 1.0


def expert_transitions(profile: RoutingTrace, alpha: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The X table of ``profile``: ``(transition [L, TRANSITION_LAGS, N, N], expert_prior [L, N])``
    float32 (module docstring), each row smoothed towards the layer's expert prior with
    ``alpha`` pseudo-occurrences of the earlier expert."""
    L, N, K = profile.num_layers, profile.num_experts, profile.top_k
    experts = profile.experts.astype(np.int64)
    prior = np.stack([np.bincount(experts[:, l].ravel(), minlength=N) for l in range(L)]).astype(np.float64)
    prior /= np.maximum(prior.sum(axis=1, keepdims=True), 1.0)
    counts, seen = _transition_counts(experts, N, TRANSITION_LAGS)
    transition = (counts / K + alpha * prior[:, None, None, :]) / np.maximum(seen[:, :, :, None] + alpha, 1e-12)
    for j in range(1, TRANSITION_LAGS + 1):
        transition[:j, j - 1] = 0.0
    return transition.astype(np.float32), prior.astype(np.float32)


@numba.njit(cache=True)
def _transition_counts(experts, num_experts, lags):
    """``([L, lags, N, N] activations of m at l by tokens that used n at l - j, [L, lags, N]
    tokens that used n at l - j)``; experts ``[T, L, K]``."""
    T, L, K = experts.shape
    out = np.zeros((L, lags, num_experts, num_experts))
    seen = np.zeros((L, lags, num_experts))
    for t in range(T):
        for l in range(L):
            for j in range(1, lags + 1):
                if l < j:
                    continue
                for a in range(K):
                    n = experts[t, l - j, a]
                    seen[l, j - 1, n] += 1.0
                    for b in range(K):
                        out[l, j - 1, n, experts[t, l, b]] += 1.0
    return out, seen


def nearest_profiled_rows(embedding: np.ndarray, profiled: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """``[V]`` int32: for every token id, the T2D row of its nearest profiled token by cosine
    similarity of input embeddings (a profiled token maps to its own row).

    Args:
        embedding: ``[V, H]`` the model's input embedding matrix.
        profiled: ``[J]`` ascending profiled token ids (``t2d_tokens``), all ``< V``.
    """
    emb = np.asarray(embedding, np.float32)
    if emb.ndim != 2:
        raise TablesError(f"embedding: expected [V, H], got shape {emb.shape}")
    profiled = np.asarray(profiled, np.int64)
    if len(profiled) == 0:
        raise TablesError("no profiled tokens to map unseen tokens to")
    if profiled.max() >= len(emb):
        raise TablesError(f"profiled token id {profiled.max()} is outside the embedding's {len(emb)} rows; "
                          "is the embedding from the model that produced the trace?")
    unit = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    keys = np.ascontiguousarray(unit[profiled].T)  # [H, J]
    rows = np.empty(len(emb), np.int32)
    for start in range(0, len(emb), chunk):
        rows[start:start + chunk] = np.argmax(unit[start:start + chunk] @ keys, axis=1)
    rows[profiled] = np.arange(len(profiled))
    return rows


def placement_device_counts(experts: np.ndarray, placement: Placement) -> np.ndarray:
    """``[T, L, E]`` uint8: how many of each token's top-k experts device ``e`` holds a copy of
    (home or replica); equals :func:`device_counts` when ``placement.redundant == 0``.

    experts: ``[T, L, K]``.
    """
    if not placement.redundant:
        return device_counts(experts, placement.expert_device, placement.ep_size)
    return _holding_counts(experts, placement.holds().astype(np.uint8))


@numba.njit(cache=True)
def _holding_counts(experts, holds):
    T, L, K = experts.shape
    E = holds.shape[2]
    out = np.zeros((T, L, E), np.uint8)
    for t in range(T):
        for l in range(L):
            for k in range(K):
                for e in range(E):
                    out[t, l, e] += holds[l, experts[t, l, k], e]
    return out


def device_counts(experts: np.ndarray, expert_device: np.ndarray, ep_size: int) -> np.ndarray:
    """``[T, L, E]`` uint8: how many of each token's top-k experts sit on each device.

    experts: ``[T, L, K]``; expert_device: ``[L, N]``.
    """
    return _device_counts(experts, expert_device.astype(np.int64), ep_size)


@numba.njit(cache=True)
def _device_counts(experts, expert_device, ep_size):
    T, L, K = experts.shape
    out = np.zeros((T, L, ep_size), np.uint8)
    for t in range(T):
        for l in range(L):
            for k in range(K):
                out[t, l, expert_device[l, experts[t, l, k]]] += 1
    return out


@numba.njit(cache=True)
def majority_device(dev_counts):
    """``[T, L]`` int64: device holding most of the token's experts (ties → lower id)."""
    T, L, E = dev_counts.shape
    out = np.zeros((T, L), np.int64)
    for t in range(T):
        for l in range(L):
            best = 0
            for e in range(1, E):
                if dev_counts[t, l, e] > dev_counts[t, l, best]:
                    best = e
            out[t, l] = best
    return out


@numba.njit(cache=True)
def _markov_counts(dev_counts):
    """``([L, E*E, E] float64 activations local per device, [L, E*E] float64 tokens)`` per
    history ``d2 * E + d1`` (majority devices at the two previous layers)."""
    T, L, E = dev_counts.shape
    major = majority_device(dev_counts)
    out = np.zeros((L, E * E, E))
    seen = np.zeros((L, E * E))
    for t in range(T):
        for l in range(2, L):
            h = major[t, l - 2] * E + major[t, l - 1]
            seen[l, h] += 1.0
            for e in range(E):
                out[l, h, e] += dev_counts[t, l, e]
    return out, seen
