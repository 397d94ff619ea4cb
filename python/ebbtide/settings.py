"""Run-time settings read from the environment: one declaration each, parsed strictly, once.

Every ``EBBTIDE_*`` (and ``TMS_*``) variable that the Python layer reads is declared here with its type, default
and meaning, the way NCCL declares its ``NCCL_PARAM``s; the native library declares its own the same way
(``csrc/param.h``). Rules that hold for every setting:

- A value is parsed the first time it is asked for and cached; :func:`reset` forgets the cache (tests).
- An unset or empty variable means the default. A value that does not parse is an
  :class:`~ebbtide.errors.SettingError` naming the variable, the value and what is accepted: never a silent default.
- The value in force is logged once at DEBUG level on the ``ebbtide.settings`` logger.

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
           "parse_int", "parse_path"]

log = logging.getLogger("ebbtide.settings")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("one of " + "/".join(_TRUE + _FALSE))


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
            raise SettingError(f"{s.name}={raw!r} is not a valid setting: expected {e} ({s.doc})",
                               name=s.name, value=raw) from None
    log.debug("%s = %r%s", s.name, value, " (default)" if raw.strip() == "" else "")
    with _lock:
        _cache[s.name] = value
    return value


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
