"""``python -m ebbtide.compat --shim-path``: print the directory that makes ``import torch_memory_saver`` load
ebbtide's implementation when it comes first on PYTHONPATH."""
import sys

from . import shim_path

if __name__ == "__main__":
    if sys.argv[1:] != ["--shim-path"]:
        print("usage: python -m ebbtide.compat --shim-path", file=sys.stderr)
        sys.exit(2)
    print(shim_path())
