"""One patch of the host engine: a vLLM class (or module) attribute the plugin replaces.

A :class:`Patch` names where it writes (``owner`` and ``attribute``), the
:data:`~vllm_semmoe.vllm_adapter.compat.INTERNALS` entry it relies on, and why;
:meth:`Patch.install` puts the replacement ``make(original)`` in place once (a second call is a
no-op) and :meth:`Patch.remove` puts back exactly what was there before: the same object in the
owner's own namespace, or nothing when the attribute was inherited (or, for a module, absent).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import compat

#: attribute set on every installed replacement: the :class:`Patch` that installed it
MARKER = "__semmoe_patch__"

_ABSENT = object()


@dataclass(eq=False)
class Patch:
    """A replacement of ``owner.attribute`` in vLLM.

    Attributes:
        internal: the :data:`~vllm_semmoe.vllm_adapter.compat.INTERNALS` entry (its ``name``) the
            patch relies on; by default also where it writes (the entry's class and member).
        why: one sentence: what the replacement does and why vLLM needs it.
        make: ``original -> replacement`` (``original``: the attribute as read through the owner,
            ``None`` when it has none). A staticmethod stays a staticmethod.
        owner: ``"module"`` or ``"module:Class"``, the object whose namespace is written, when it
            is not the entry's class (e.g. a module global the entry's function reads).
        attribute: the attribute replaced, when it is not the entry's member.
    """

    internal: str
    why: str
    make: Callable[[Any], Any]
    owner: str = ""
    attribute: str = ""
    _saved: Any = field(default=_ABSENT, init=False, repr=False)
    _installed: Any = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not (self.owner and self.attribute):
            entry = self.entry()
            cls, _, member = entry.qualname.rpartition(".")
            self.owner = self.owner or f"{entry.module}:{cls}"
            self.attribute = self.attribute or member

    @property
    def name(self) -> str:
        """``Class.attribute`` (``module.attribute`` for a module global)."""
        module, _, qualname = self.owner.partition(":")
        return f"{qualname or module}.{self.attribute}"

    def entry(self) -> compat.Internal:
        """The :data:`~vllm_semmoe.vllm_adapter.compat.INTERNALS` entry this patch names
        (``LookupError`` when there is none)."""
        for internal in compat.INTERNALS:
            if internal.name == self.internal:
                return internal
        raise LookupError(f"semmoe patch of {self.internal}: not in compat.INTERNALS; add the internal there")

    def target(self):
        """The live owner object (``ImportError`` / ``AttributeError`` when vLLM has moved it)."""
        module, _, qualname = self.owner.partition(":")
        obj = importlib.import_module(module)
        for part in filter(None, qualname.split(".")):
            obj = getattr(obj, part)
        return obj

    def missing(self) -> str | None:
        """``None`` when the owner exists, else the dotted name of what is missing."""
        module, _, qualname = self.owner.partition(":")
        try:
            obj = importlib.import_module(module)
        except Exception as exc:  # ImportError, or anything the import raised
            return f"module {module} ({type(exc).__name__}: {exc})"
        path = module
        for part in filter(None, qualname.split(".")):
            path = f"{path}.{part}"
            obj = getattr(obj, part, None)
            if obj is None:
                return path
        return None

    @property
    def installed(self) -> bool:
        """Whether the owner's namespace holds this patch's replacement now."""
        if self._installed is None:
            return False
        try:
            return vars(self.target()).get(self.attribute) is self._installed
        except (ImportError, AttributeError):
            return False

    def install(self) -> None:
        """Put the replacement in place (no-op when it is already)."""
        if self.installed:
            return
        owner = self.target()
        own = vars(owner).get(self.attribute, _ABSENT)
        original = getattr(owner, self.attribute, None)
        replacement = self.make(original)
        setattr(replacement, MARKER, self)
        stored = staticmethod(replacement) if isinstance(own, staticmethod) else replacement
        setattr(owner, self.attribute, stored)
        self._saved, self._installed = own, vars(owner)[self.attribute]

    def remove(self) -> None:
        """Restore what the owner held before :meth:`install` (no-op when not installed)."""
        if not self.installed:
            self._installed = None
            return
        owner = self.target()
        if self._saved is _ABSENT:
            delattr(owner, self.attribute)
        else:
            setattr(owner, self.attribute, self._saved)
        self._saved, self._installed = _ABSENT, None


def installed_patch(value) -> Patch | None:
    """The :class:`Patch` that installed ``value`` (a function or staticmethod), if any."""
    return getattr(getattr(value, "__func__", value), MARKER, None)
