#!/usr/bin/env python3
"""The colocated RL example: a trainer and a rollout process share the GPU(s) and hand the memory back and forth
every step. The code lives in python/ebbtide/colocate/ (trainer.py and rollout.py are the two processes); this
script is the same as ``python -m ebbtide.colocate``. See README.md here for the flags and what it prints."""
import sys

from ebbtide.colocate import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
