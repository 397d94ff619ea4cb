"""run_json_worker: the result line, a failing worker's exit status and last lines, a worker past its deadline."""
import os
import pathlib

from ebbtide.bench.suites._process import run_json_worker

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pathlib.Path(__file__).parent),
                                                   os.environ.get("PYTHONPATH", "")]))


def test_the_last_json_line_is_the_result():
    assert run_json_worker("json_echo_worker", ['{"rows": [1, 2]}'], ENV, 60) == ({"rows": [1, 2]}, "")


def test_a_failing_worker_says_why():
    res, why = run_json_worker("json_echo_worker", ["fail"], ENV, 60)
    assert res is None and why.startswith("worker failed (4)") and "the measurement broke" in why


def test_a_worker_past_its_deadline_is_stopped():
    res, why = run_json_worker("json_echo_worker", ["sleep"], ENV, 2)
    assert res is None and why == "timed out after 2 s"
