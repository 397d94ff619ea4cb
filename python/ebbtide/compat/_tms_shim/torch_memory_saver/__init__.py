"""``torch_memory_saver`` served by ebbtide (this directory is first on sys.path: see ebbtide.compat)."""
from ebbtide.compat.torch_memory_saver import TorchMemorySaver, configure_subprocess, torch_memory_saver  # noqa: F401

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess"]
