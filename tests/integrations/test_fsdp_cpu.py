"""The FSDP2 adapter on the CPU: a transformers Qwen3 under fully_shard over a 2-rank Gloo mesh (torch's FSDP2 trains
on a CPU mesh), the memory tags in the host-memory fake of the CUDA driver (so pause really unmaps and resume maps
back at the same addresses). GPU runs of the same: test_fsdp_gpu.py."""
import contextlib
import multiprocessing as mp

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.fsdp")

from ebbtide import _native  # noqa: E402
from ebbtide.testing import spawn  # noqa: E402
from ebbtide.testing.ports import free_port  # noqa: E402

FAKE = _native.PACKAGE_DIR / "libebbtide_fake_cuda.so"
needs_fake = pytest.mark.skipif(not FAKE.exists(), reason="the fake CUDA driver (libebbtide_fake_cuda.so) is not built")


@pytest.fixture
def fake_driver(monkeypatch):
    monkeypatch.setenv("EBBTIDE_LIBCUDA", str(FAKE))  # inherited by the spawned ranks


@needs_fake
def test_offload_restore_every_step_trains_bit_for_bit_and_keeps_addresses(fake_driver):
    res = spawn.ranks("memory_round_trip", 2, module="fsdp_workers", timeout=300, steps=4)
    # the bitwise comparison with the twin runs inside each rank; here: every step ran, each rank its own data
    assert all(len(r["losses"]) == 4 for r in res) and res[0]["losses"] != res[1]["losses"], res
    assert all(r["paused"] == {"fsdp_weights": "paused", "fsdp_optimizer": "paused"} for r in res), res


@needs_fake
def test_refusals_change_nothing(fake_driver):
    res = spawn.ranks("refusals", 2, module="fsdp_workers", timeout=300)
    want = {"not wrapped": "InvalidArgumentError", "plain Distributed": "UnsupportedError", "HSDP": "UnsupportedError",
            "CPUOffloadPolicy": "UnsupportedError", "not a GPU": "UnsupportedError", "in flight": "StateError",
            "without offload": "StateError", "called twice": "StateError", "was replaced": "StateError",
            "install_groups": "StateError"}
    assert all(r["seen"] == want for r in res), res


def test_weights_reach_the_receiver_bit_for_bit_with_one_gather_per_bucket():
    res = spawn.ranks("weights_sync", 2, module="fsdp_workers", timeout=300)
    assert res[0]["buckets"] > 2 and res[0]["names"][0].startswith("model."), res


@contextlib.contextmanager
def _dying(where):
    import fsdp_workers

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=fsdp_workers.dying_rank, args=(r, 2, port, where, q)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        yield q, procs
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


@needs_fake
@pytest.mark.parametrize("where, error, words", [
    ("offload", "WaitTimeoutError", "1"),
    ("gather", "PartialUpdateError", "gather of bucket"),
])
def test_a_rank_dying_gives_the_other_a_typed_error_in_bounded_time(fake_driver, where, error, words):
    with _dying(where) as (q, procs):
        err, msg, took = q.get(timeout=240)
        assert err == error and words in msg, (err, msg)
        assert took < 60, took  # the release's timeout is 10 s, the group's 15 s
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0]


@needs_fake
@pytest.mark.parametrize("weights, steps, offload", [("copy", 20, True), ("discard", 6, True), ("copy", 6, False)])
def test_sharded_adam_is_bit_identical_to_torch_adamw(fake_driver, weights, steps, offload):
    """20 steps with an offload after each; the discard mode; and without offloads (zero_grad alone clears the
    gradients FSDP would otherwise accumulate into)."""
    res = spawn.ranks("exact_sharded_adam", 2, module="fsdp_workers", timeout=400, steps=steps,
                             weights=weights, offload=offload)
    assert all(len(r["losses"]) == steps for r in res), res


def test_the_mesh_groups_release_and_reload():
    res = spawn.ranks("groups_cycle", 2, module="fsdp_workers", timeout=300)
    assert all(len(r["losses"]) == 2 for r in res), res


def test_sharded_adam_refuses_a_stale_shard_by_name():
    """model.to() that moves the values, load_state_dict(assign=True) and a set_ onto the local tensor each leave
    the optimizer holding memory the model no longer reads: its step raises StateError naming the parameter."""
    res = spawn.ranks("stale_shards", 1, module="fsdp_workers", timeout=300)
    assert res[0]["seen"] == ["was moved since sharded_adam()", "new Parameter", "moved to another storage"], res
