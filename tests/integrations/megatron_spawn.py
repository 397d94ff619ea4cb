"""The integration tests' spawn helper: the repository's rank launcher with this folder on the ranks' sys.path."""
import os

from ebbtide.bench import _spawn

HERE = os.path.dirname(os.path.abspath(__file__))


def run(fn: str, world: int, *, module: str, timeout: float = 150.0, **kwargs) -> list:
    return _spawn.run(fn, world, module=module, timeout=timeout, path=[HERE], **kwargs)
