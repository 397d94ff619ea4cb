"""GPU inventory through NVML (nvidia-ml-py), used by `ebbtide info` and benchmark environment records.
Never raises: reports why it could not look."""
from __future__ import annotations


def gpus() -> tuple[list[dict], str]:
    """([{index, name, memory_total, memory_used, uuid}], reason-if-empty)."""
    try:
        import pynvml  # noqa: PLC0415  (package nvidia-ml-py)
    except ImportError:
        return [], "nvidia-ml-py not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return [], f"NVML unavailable: {e}"
    try:
        out = []
        driver = pynvml.nvmlSystemGetDriverVersion()
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            out.append({
                "index": i,
                "name": name.decode() if isinstance(name, bytes) else name,
                "memory_total": int(mem.total),
                "memory_used": int(mem.used),
                "driver": driver.decode() if isinstance(driver, bytes) else driver,
            })
        return out, "" if out else "NVML reports no GPU"
    finally:
        pynvml.nvmlShutdown()
