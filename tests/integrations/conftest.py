"""tests/integrations: this folder on sys.path (the rank bodies: megatron_workers, megatron_opt_workers, ...)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
