"""The FSDP2 adapter's small pieces in one process: flat re-backing (tensor objects kept, content moved, the old
storage released, slots aligned, nothing changed on a refusal) and the served names."""
import pytest

torch = pytest.importorskip("torch")

from ebbtide.errors import InvalidArgumentError  # noqa: E402
from ebbtide.integrations.fsdp import served_name  # noqa: E402
from ebbtide.integrations.fsdp._flat import ALIGN_BYTES, pack  # noqa: E402


def plain_factory(tag, backup, numel, dtype, device):
    return torch.empty(numel, dtype=dtype, device=device)


def _shards():
    a = torch.arange(10, dtype=torch.float32)  # a padded shard, and a view of its front (a DTensor's local tensor)
    b = torch.arange(100, 300, dtype=torch.bfloat16)
    return [[a, a[:7]], [b.view(20, 10), b.view(20, 10)[:5]], [torch.full((3,), 7.0)]]


def test_pack_rebacks_in_place_moves_the_content_and_releases_the_old_storage():
    groups = _shards()
    ids = [[id(t) for t in g] for g in groups]
    want = [[t.clone() for t in g] for g in groups]
    old = [g[0].untyped_storage() for g in groups]
    flat = pack(groups, plain_factory, "t", "cpu")
    assert [[id(t) for t in g] for g in groups] == ids
    assert all(torch.equal(t, w) for g, wg in zip(groups, want) for t, w in zip(g, wg))
    assert all(s.nbytes() == 0 for s in old)
    assert all(flat.owns(t) for g in groups for t in g) and not flat.owns(torch.zeros(3))
    f32 = [g for g in groups if g[0].dtype == torch.float32]
    starts = sorted(g[0].data_ptr() - f32[0][0].untyped_storage().data_ptr() for g in f32)
    assert starts == [0, ALIGN_BYTES]  # each slot aligned; the views follow their first tensor
    assert groups[0][1].data_ptr() == groups[0][0].data_ptr()
    groups[0][1].add_(1)  # still a view of the slot
    assert groups[0][0][0].item() == 1.0


@pytest.mark.parametrize("bad", ["short", "dtype", "not a tensor"])
def test_a_wrong_buffer_changes_nothing(bad):
    groups = _shards()
    ptrs = [[t.data_ptr() for t in g] for g in groups]

    def factory(tag, backup, numel, dtype, device):
        if bad == "short":
            return torch.empty(numel - 1, dtype=dtype)
        if bad == "dtype":
            return torch.empty(numel, dtype=torch.float16)
        return [0] * numel

    with pytest.raises(InvalidArgumentError, match="buffer_factory must return"):
        pack(groups, factory, "t", "cpu")
    assert [[t.data_ptr() for t in g] for g in groups] == ptrs


def test_a_tensor_that_does_not_cover_its_storage_is_refused():
    base = torch.zeros(10)
    with pytest.raises(InvalidArgumentError, match="does not cover its storage"):
        pack([[base[2:]]], plain_factory, "t", "cpu")
    with pytest.raises(InvalidArgumentError, match="views of its first tensor"):
        pack([[torch.zeros(4), torch.zeros(2)]], plain_factory, "t", "cpu")


def test_served_names_drop_the_wrappers_segments():
    assert served_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert served_name("_orig_mod.model.norm.weight") == "model.norm.weight"
    assert served_name("module.lm_head.weight") == "lm_head.weight"
