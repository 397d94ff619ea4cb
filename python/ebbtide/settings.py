"""Run-time settings read from the environment: one declaration each, parsed strictly, once.

Every ``EBBTIDE_*`` (and ``TMS_*``) variable that the Python layer reads is declared here with its type, default
and meaning, the way NCCL declares its ``NCCL_PARAM``s; the native library declares its own the same way
(``csrc/param.h``). Rules that hold for every setting:

- A value is parsed the first time it is asked for and cached; :func:`reset` forgets the cache (tests).
- An unset or empty variable means the default. A value that does not parse is an
  :class:`~ebbtide.errors.SettingError` naming the variable, the value and what is accepted: never a silent default.
- The value in force is logged once at DEBUG level on the ``ebbtide.settings`` logger.
- Each component checks its settings, Python and native, when it is imported (``ebbtide.memory``,
  ``ebbtide.optim``, ``ebbtide.quant``) or installed (``ebbtide.comm.install``): :func:`check_component`, with the
  table ``COMPONENTS``. A bad value fails there, not at the first call that happens to read it.
  :func:`problems` checks every component at once and raises nothing (``ebbtide info``, ``ebbtide bench``).

``docs/settings.md`` lists every variable, Python and native; a test checks that list against the sources.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Callable

from .errors import SettingError

__all__ = ["Setting", "declare", "get", "reset", "declared", "parse_bool", "parse_choice", "parse_float",
           "parse_int", "parse_path", "COMPONENTS", "DECLARING_MODULES", "check_component", "problems"]

log = logging.getLogger("ebbtide.settings")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("/".join(_TRUE) + " or " + "/".join(_FALSE) + " (any case)")


def parse_choice(*choices: str) -> Callable[[str], str]:
    """Case-sensitive choice among ``choices`` (a misspelt or wrongly cased value is an error)."""
    def parse(text: str) -> str:
        v = text.strip()
        if v not in choices:
            raise ValueError("one of " + ", ".join(choices))
        return v
    parse.accepted = "one of " + ", ".join(choices)  # type: ignore[attr-defined]
    return parse


def parse_float(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text.strip())
        except ValueError:
            raise ValueError(_range_text("a number", lo, hi, lo_open)) from None
        if v != v or (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
            raise ValueError(_range_text("a number", lo, hi, lo_open))
        return v
    return parse


def parse_int(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text.strip(), 0)
        except ValueError:
            raise ValueError(_range_text("an integer", lo, hi, False)) from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError(_range_text("an integer", lo, hi, False))
        return v
    return parse


def parse_path(text: str) -> str:
    return os.path.expanduser(text.strip())


def _range_text(what: str, lo, hi, lo_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"{what} in [{lo}, {hi}]"
    if lo is not None:
        return f"{what} {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f"{what} <= {hi}"
    return what


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str                      # the environment variable
    parse: Callable[[str], Any]    # text -> value; raises ValueError(accepted) on a bad value
    default: Any                   # the value when the variable is unset or empty
    doc: str                       # one line: what it changes

    def accepted(self) -> str:
        return getattr(self.parse, "accepted", None) or _probe_accepted(self.parse)


def _probe_accepted(parse) -> str:
    try:
        parse("\0not-a-value\0")
    except ValueError as e:
        return str(e)
    return "any text"


_lock = threading.Lock()           # guards _declared and _cache
_declared: dict[str, Setting] = {}
_cache: dict[str, Any] = {}


def declare(name: str, parse: Callable[[str], Any], default: Any, doc: str) -> Setting:
    """Declare a setting (at import of the module that owns it). Declaring one name twice with another meaning
    is a programming error."""
    s = Setting(name, parse, default, doc)
    with _lock:
        old = _declared.get(name)
        if old is not None and (old.default != default or old.doc != doc):
            raise RuntimeError(f"setting {name} declared twice with different meanings")
        _declared[name] = s
    return s


def get(setting: Setting | str) -> Any:
    """The value in force: parsed from the environment on first use, cached after."""
    s = _declared[setting] if isinstance(setting, str) else setting
    with _lock:
        if s.name in _cache:
            return _cache[s.name]
    raw = os.environ.get(s.name, "")
    if raw.strip() == "":
        value = s.default
    else:
        try:
            value = s.parse(raw)
        except ValueError as e:
            raise SettingError(f"{s.name}={raw!r} is not a valid setting: expected {e}; fix it, or unset {s.name} "
                               f"for the default ({_default_text(s.default)}). {s.name}: {s.doc}",
                               name=s.name, value=raw) from None
    log.debug("%s = %r%s", s.name, value, " (default)" if raw.strip() == "" else "")
    with _lock:
        _cache[s.name] = value
    return value


def _default_text(value: Any) -> str:
    if value == "" or value is None:
        return "unset"
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def reset(name: str | None = None) -> None:
    """Forget cached values (all, or one), so the next :func:`get` reads the environment again."""
    with _lock:
        if name is None:
            _cache.clear()
        else:
            _cache.pop(name, None)


def declared() -> list[Setting]:
    with _lock:
        return sorted(_declared.values(), key=lambda s: s.name)


# ---- checked when each component is imported or installed -------------------------------------------------------
# component -> (its Python settings by name, the native checks it needs). A native check is one cheap query that
# fails with the native SettingError when a setting of that native part does not parse (the native library caches
# the outcome: csrc/param.h). The memory engine's disk-tier settings are read at the disk tier's first use, as
# torch_memory_saver reads its own (a program may set them after importing the library), so no check here reads
# them.
_NATIVE_CHECKS: dict[str, Callable[[Any], Any]] = {
    "logger": lambda C: C.log_get(),           # EBBTIDE_DEBUG, EBBTIDE_DEBUG_SUBSYS
    "cpu_isa": lambda C: C.cpu_isa(),          # EBBTIDE_CPU_ISA
    "memory": lambda C: C.memory.coalescing(),  # the engine's load-time settings (EBBTIDE_MEM_*, TMS_*)
}
COMPONENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "memory": (("EBBTIDE_MEM_CHECK",), ("logger", "memory")),
    "optim": (("EBBTIDE_ADAM_TASKS_PER_THREAD",), ("logger", "cpu_isa")),
    "quant": (("EBBTIDE_QUANT_KERNELS",), ("logger",)),
    "comm": (("EBBTIDE_COMM_TIMEOUT", "EBBTIDE_COMM_WARMUP"), ()),
    "bench": (("EBBTIDE_BENCH_MEMORY_ROWS", "EBBTIDE_BENCH_DISK_DIR"), ()),
}
# The modules whose import declares the Python settings above (problems() imports them to see every declaration;
# tests/core/test_user_errors.py checks this list against the sources). Test support (ebbtide.testing) reads its
# own settings where it uses them: the library does not import it.
DECLARING_MODULES = ("ebbtide.memory._check", "ebbtide.optim.cpu_adam", "ebbtide.quant._dispatch",
                     "ebbtide.comm._runtime", "ebbtide.comm._backend", "ebbtide.bench.suites.memory")
_collecting = threading.local()  # .on: problems() is importing the declaring modules (checks run there instead)


def _errors(names, native, *, declared_only: bool = False) -> list[SettingError]:
    errors = []
    for name in names:
        if declared_only and name not in _declared:
            continue  # its module could not be imported here (a missing dependency): nothing reads it
        try:
            get(name)
        except SettingError as e:
            errors.append(e)
    if native:
        from . import _native  # noqa: PLC0415  (settings is imported by everything; the native part only here)

        try:
            C = _native.load()
        except ImportError:
            C = None  # no native build: its first call says how to build it
        for key in native if C is not None else ():
            try:
                _NATIVE_CHECKS[key](C)
            except SettingError as e:
                errors.append(e)
    return errors


def check_component(component: str) -> None:
    """Raise the first SettingError among ``component``'s settings (``COMPONENTS``), Python and native. Called
    where the component is imported or installed."""
    if getattr(_collecting, "on", False):
        return
    errors = _errors(*COMPONENTS[component])
    if errors:
        raise errors[0]


def problems() -> list[SettingError]:
    """Every setting of every component that does not parse, one error per variable (raises nothing): what
    ``ebbtide info`` reports and what ``ebbtide bench`` refuses before it runs."""
    import importlib  # noqa: PLC0415

    _collecting.on = True
    try:
        for module in DECLARING_MODULES:
            try:
                importlib.import_module(module)
            except ImportError:
                pass  # a component whose dependencies are missing (torch): nothing reads its settings here
    finally:
        _collecting.on = False
    seen: dict[str, SettingError] = {}
    for names, native in COMPONENTS.values():
        for e in _errors(names, native, declared_only=True):
            seen.setdefault(e.name or str(e), e)
    return list(seen.values())
