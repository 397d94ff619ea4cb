"""ebbtide's benchmark suite: every figure beside its anchor and the physical limit, measured in the same run.
Run it with `ebbtide bench` (see `ebbtide bench --help`)."""
from .registry import Context, Row, Skip, suite

__all__ = ["Context", "Row", "Skip", "suite"]
