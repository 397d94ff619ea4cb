"""Every native status maps to one typed Python exception, and native failures arrive as those exceptions."""
import pytest

import ebbtide
from ebbtide import _native
from ebbtide.errors import EbbtideError, Status, check, error_for

C = _native.load()


def test_python_enum_mirrors_native_statuses():
    assert C.status_count() == len(Status)
    texts = [C.status_string(s) for s in range(C.status_count())]
    assert all(texts) and len(set(texts)) == len(texts)
    assert C.status_string(C.status_count()) == "unknown ebbtide status"


@pytest.mark.parametrize("status", [s for s in Status if s is not Status.SUCCESS])
def test_every_status_maps_to_its_class(status):
    exc = error_for(int(status), "msg")
    assert isinstance(exc, EbbtideError)
    assert exc.status is status
    assert type(exc).__name__ in ebbtide.__all__
    with pytest.raises(type(exc), match="what: msg"):
        check(int(status), "what", "msg")


def test_success_and_unknown_status():
    check(0, "fine")
    assert isinstance(error_for(999, "x"), ebbtide.InternalError)
    with pytest.raises(ValueError):
        error_for(0)


def test_classes_also_match_builtin_families():
    assert issubclass(ebbtide.InvalidArgumentError, ValueError)
    assert issubclass(ebbtide.OutOfMemoryError, MemoryError)
    assert issubclass(ebbtide.NotFoundError, LookupError)
    assert issubclass(ebbtide.WaitTimeoutError, TimeoutError)
    assert issubclass(ebbtide.DriverNotFoundError, ebbtide.DriverError)
    oom = ebbtide.OutOfMemoryError("x", needed=10, free=2, holders={"kv": 8})
    assert (oom.needed, oom.free, oom.holders) == (10, 2, {"kv": 8})


def test_native_failure_raises_typed_error_with_native_message():
    with pytest.raises(ebbtide.InvalidArgumentError, match="bytes_per_array must be >= 4096, got 16"):
        C.host_triad_bandwidth(16, 1, 1)
    with pytest.raises(ebbtide.InvalidArgumentError):
        C.log_configure(7, 0)
