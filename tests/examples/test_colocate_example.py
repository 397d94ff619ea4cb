"""examples/colocate/colocate.py, the colocated loop on the public API alone: end to end on the CPU (its processes,
groups, optimizer and weight update; nothing to pause) and on a GPU (the memory handed over and back)."""
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "colocate" / "colocate.py"
SMALL = ["--vocab", "256", "--d-model", "128", "--layers", "2", "--batch", "2", "--seq", "32", "--new-tokens", "4"]


def _run(*args, timeout=300):
    p = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=timeout)
    return p, p.stdout + p.stderr


def _steps(out: str) -> list:
    return [line for line in out.splitlines() if re.match(r"step \d+: loss ", line)]


def test_the_example_runs_on_cpu():
    p, out = _run("--device", "cpu", "--steps", "2", "--kv-gib", "0", *SMALL)
    assert p.returncode == 0, out[-4000:]
    steps = _steps(out)
    assert len(steps) == 2 and all(line.endswith("the rollout holds the trainer's weights (FP8): True")
                                   for line in steps), out[-4000:]
    assert "colocated loop: OK" in out


def test_a_bad_argument_is_a_usage_error():
    p, out = _run("--device", "tpu")
    assert p.returncode == 2 and "--device" in out and "Traceback" not in out


@pytest.mark.gpu
def test_the_example_hands_the_gpu_over_and_back():
    p, out = _run("--steps", "3", timeout=600)
    assert p.returncode == 0, out[-6000:]
    steps = _steps(out)
    assert len(steps) == 3, out[-6000:]
    for line in steps:
        assert line.endswith("the rollout holds the trainer's weights (FP8): True"), line
        paused = float(re.search(r"trainer paused ([0-9.]+) GiB", line).group(1))
        assert paused > 0.05, line  # the weights (0.1 GB of bf16) and the gradients went back to the driver
    assert "colocated loop: OK" in out
