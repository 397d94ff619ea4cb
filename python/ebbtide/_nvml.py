"""NVML queries (nvidia-ml-py), the package's one reader of them: the GPU inventory (`ebbtide info`, benchmark
environment records), one device's per-process memory, memory in use and SM clock (``memory.release_report``, the
colocated loop's measurements), and the processes on every GPU. Never raises: each call says why it could not look
(``why``, or the reason beside an empty result)."""
from __future__ import annotations

__all__ = ["gpus", "Device", "compute_pids", "NOT_INSTALLED"]

NOT_INSTALLED = "nvidia-ml-py not installed (pip install nvidia-ml-py)"


def _init():
    """(pynvml, "") once NVML is initialised (pair it with ``nvmlShutdown``: NVML counts), else (None, why)."""
    try:
        import pynvml  # noqa: PLC0415  (package nvidia-ml-py)
    except ImportError:
        return None, NOT_INSTALLED
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 (NVMLError_LibraryNotFound, DriverNotLoaded, ...)
        return None, f"NVML unavailable: {e}"
    return pynvml, ""


def _text(s) -> str:
    return s.decode() if isinstance(s, bytes) else s


def gpus() -> tuple[list[dict], str]:
    """([{index, name, memory_total, memory_used, driver}], reason-if-empty)."""
    pynvml, why = _init()
    if pynvml is None:
        return [], why
    try:
        out = []
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append({"index": i, "name": _text(pynvml.nvmlDeviceGetName(h)), "memory_total": int(mem.total),
                        "memory_used": int(mem.used), "driver": driver})
        return out, "" if out else "NVML reports no GPU"
    finally:
        pynvml.nvmlShutdown()


def compute_pids() -> list[int]:
    """PIDs with a compute context on any GPU, as NVML reports them ([] without NVML)."""
    pynvml, _why = _init()
    if pynvml is None:
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out += [int(p.pid) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
        return sorted(set(out))
    except Exception:  # noqa: BLE001
        return []
    finally:
        pynvml.nvmlShutdown()


class Device:
    """One GPU, found by ``uuid`` (torch's ``get_device_properties(d).uuid``, with or without NVML's "GPU-"
    prefix) or else by ``index``; the UUID wins where both are given and it resolves (under MIG or another UUID
    format the index is used). ``ok`` when a handle is open; ``why`` says what is missing or what failed last.
    ``close()`` gives NVML back (NVML counts its initialisations)."""

    def __init__(self, *, uuid: str | None = None, index: int | None = None):
        self._nvml, self.why = _init()
        self._h = None
        if self._nvml is None:
            return
        try:
            if uuid:
                try:
                    self._h = self._nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid)
                except Exception:  # noqa: BLE001 (MIG or a different format: fall back to the index)
                    if index is None:
                        raise
            if self._h is None:
                self._h = self._nvml.nvmlDeviceGetHandleByIndex(int(index or 0))
        except Exception as e:  # noqa: BLE001
            self.why = f"NVML has no such device (uuid {uuid!r}, index {index!r}): {type(e).__name__}: {e}"
            self.close()

    @property
    def ok(self) -> bool:
        return self._h is not None

    def processes(self) -> dict[int, int | None] | None:
        """{pid: bytes used} as NVML reports them (None bytes where the driver hides them); None where it could not
        ask (``why`` says why). Containers often see host PIDs here, not their own."""
        if not self.ok:
            return None
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._h)
        except Exception as e:  # noqa: BLE001
            self.why = f"nvmlDeviceGetComputeRunningProcesses: {e}"
            return None
        return {int(p.pid): (int(p.usedGpuMemory) if p.usedGpuMemory is not None else None) for p in procs}

    def memory_used(self) -> int | None:
        if not self.ok:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._h).used)
        except Exception:  # noqa: BLE001
            return None

    def sm_clock_mhz(self) -> int | None:
        """The device's SM clock now (MHz), or None."""
        if not self.ok:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetClockInfo(self._h, self._nvml.NVML_CLOCK_SM))
        except Exception:  # noqa: BLE001
            return None

    def close(self) -> None:
        if self._nvml is not None:
            self._h = None
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self._nvml = None
