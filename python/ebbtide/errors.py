"""Typed exceptions, and the one table that maps native statuses onto them.

Every native call returns an ``ebt_status_t``; Python code passes it to :func:`check`, which raises the
matching class with the status text and the thread's last native message. The numbering mirrors
``csrc/ebbtide.h`` (append-only); ``tests/core/test_errors.py`` walks every value.
"""
from __future__ import annotations

import enum
import re

__all__ = [
    "Status",
    "EbbtideError",
    "InvalidArgumentError",
    "SettingError",
    "StateError",
    "OutOfMemoryError",
    "HostOutOfMemoryError",
    "DriverError",
    "DriverNotFoundError",
    "UnsupportedError",
    "NotFoundError",
    "SystemCallError",
    "NcclError",
    "InternalError",
    "CudaRuntimeError",
    "VersionMismatchError",
    "WaitTimeoutError",
    "StepError",
    "check",
    "error_for",
]


class Status(enum.IntEnum):
    SUCCESS = 0
    INVALID_ARGUMENT = 1
    INVALID_STATE = 2
    OUT_OF_MEMORY = 3
    DRIVER = 4
    DRIVER_NOT_FOUND = 5
    UNSUPPORTED = 6
    NOT_FOUND = 7
    SYSTEM = 8
    NCCL = 9
    INTERNAL = 10
    HOST_OUT_OF_MEMORY = 11
    CUDA_RUNTIME = 12
    VERSION_MISMATCH = 13
    TIMEOUT = 14
    SETTING = 15


class EbbtideError(RuntimeError):
    """Base class of every error ebbtide raises. ``status`` is the native status (or None for pure-Python
    errors)."""

    status: Status | None = None

    def __init__(self, message: str = "", status: Status | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class InvalidArgumentError(EbbtideError, ValueError):
    """Bad argument: wrong dtype, shape, device, size or flag. Nothing was changed."""

    status = Status.INVALID_ARGUMENT


class SettingError(InvalidArgumentError):
    """An environment setting whose value does not parse. ``name`` is the variable, ``value`` the text found; the
    message says what is accepted. Raised where the setting is first read (Python), or by every call into the
    native component that owns it (native status SETTING); nothing was changed."""

    status = Status.SETTING

    def __init__(self, message: str = "", status: Status | None = None, *, name: str = "", value: str = ""):
        super().__init__(message, status)
        self.name = name
        self.value = value


class StateError(EbbtideError):
    """The object is not in a state that allows the operation (e.g. use after release)."""

    status = Status.INVALID_STATE


class OutOfMemoryError(EbbtideError, MemoryError):
    """Device memory ran out. ``needed`` and ``free`` are bytes (None when unknown); ``holders`` maps a tag to
    the bytes it holds on that device. The operation rolled back and can be retried."""

    status = Status.OUT_OF_MEMORY

    def __init__(self, message: str = "", status: Status | None = None, *, needed: int | None = None,
                 free: int | None = None, holders: dict | None = None):
        super().__init__(message, status)
        self.needed = needed
        self.free = free
        self.holders = dict(holders or {})


class HostOutOfMemoryError(OutOfMemoryError):
    """Host (pinned) memory ran out."""

    status = Status.HOST_OUT_OF_MEMORY


class DriverError(EbbtideError):
    """A CUDA driver call failed; the message names the call and the driver's error."""

    status = Status.DRIVER


class DriverNotFoundError(DriverError):
    """No usable CUDA driver (libcuda.so.1 missing, or no device)."""

    status = Status.DRIVER_NOT_FOUND


class UnsupportedError(EbbtideError):
    """Not available in this build, on this driver, or on this device."""

    status = Status.UNSUPPORTED


class NotFoundError(EbbtideError, LookupError):
    """Unknown tag, address or name."""

    status = Status.NOT_FOUND


class SystemCallError(EbbtideError, OSError):
    """An operating-system call failed."""

    status = Status.SYSTEM


class NcclError(EbbtideError):
    """An NCCL call failed."""

    status = Status.NCCL


class InternalError(EbbtideError):
    """A bug in ebbtide; please report it with the message."""

    status = Status.INTERNAL


class CudaRuntimeError(EbbtideError):
    """A kernel launch or CUDA runtime call failed."""

    status = Status.CUDA_RUNTIME


class VersionMismatchError(EbbtideError, ImportError):
    """Components of different ebbtide builds were mixed (extension, runtime library, Python package)."""

    status = Status.VERSION_MISMATCH


class WaitTimeoutError(EbbtideError, TimeoutError):
    """A wait ran past its deadline; the message says who did not arrive."""

    status = Status.TIMEOUT


class StepError(EbbtideError):
    """An optimizer step was interrupted in the middle (a CPU kernel, a copy or a bucket hook raised). ``completed``
    True: the step was finished without the part that failed, so master, moments and params all hold the new
    version (``step`` is its number); False: it could not be finished, the optimizer refuses further use until a
    checkpoint is loaded. ``bucket`` is where it failed, of ``buckets``. The original error is ``__cause__``."""

    def __init__(self, message: str, *, completed: bool, step: int, bucket: int, buckets: int):
        super().__init__(message)
        self.completed, self.step, self.bucket, self.buckets = completed, step, bucket, buckets


_BY_STATUS: dict[Status, type[EbbtideError]] = {
    Status.INVALID_ARGUMENT: InvalidArgumentError,
    Status.INVALID_STATE: StateError,
    Status.OUT_OF_MEMORY: OutOfMemoryError,
    Status.DRIVER: DriverError,
    Status.DRIVER_NOT_FOUND: DriverNotFoundError,
    Status.UNSUPPORTED: UnsupportedError,
    Status.NOT_FOUND: NotFoundError,
    Status.SYSTEM: SystemCallError,
    Status.NCCL: NcclError,
    Status.INTERNAL: InternalError,
    Status.HOST_OUT_OF_MEMORY: HostOutOfMemoryError,
    Status.CUDA_RUNTIME: CudaRuntimeError,
    Status.VERSION_MISMATCH: VersionMismatchError,
    Status.TIMEOUT: WaitTimeoutError,
    Status.SETTING: SettingError,
}

# The native message for SETTING (csrc/param.cc): "NAME='value' is not a valid setting: expected ...".
_NATIVE_SETTING = re.compile(r"\b([A-Z][A-Z0-9_]*)='(.*?)' is not a valid setting")


def error_for(status: int, message: str = "") -> EbbtideError:
    """The exception instance for a failing native status (an unknown value becomes InternalError)."""
    try:
        st = Status(status)
    except ValueError:
        return InternalError(f"unknown native status {status}: {message}", Status.INTERNAL)
    if st is Status.SUCCESS:
        raise ValueError("error_for(SUCCESS): not an error")
    if st is Status.SETTING:
        m = _NATIVE_SETTING.search(message)
        return SettingError(message, st, name=m.group(1) if m else "", value=m.group(2) if m else "")
    return _BY_STATUS[st](message, st)


def check(status: int, what: str = "", last_error: str = "") -> None:
    """Raise the typed exception for ``status`` unless it is SUCCESS. ``what`` names the operation;
    ``last_error`` is the native thread-local message."""
    if status == 0:
        return
    parts = [p for p in (what, last_error) if p]
    raise error_for(status, ": ".join(parts) if parts else Status(status).name.lower().replace("_", " "))
