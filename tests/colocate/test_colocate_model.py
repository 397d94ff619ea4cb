"""The example's model on the CPU: KV-cache decode against the full forward, config and argument errors."""
import pytest
import torch

from ebbtide.colocate import KVCache, ModelConfig, TinyLM, greedy_decode
from ebbtide.errors import InvalidArgumentError

TINY = ModelConfig(vocab=256, d_model=128, n_layers=2, n_heads=4, d_ff=256, max_seq=128)
ATOL = 1e-4  # fp32: cached and full attention differ only in summation order


def _model(seed=0):
    return TinyLM.random(TINY, seed=seed, dtype=torch.float32)


def test_same_seed_same_weights_and_params_counted():
    a, b, c = _model(0), _model(0), _model(1)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
    assert not all(torch.equal(p, r) for p, r in zip(a.parameters(), c.parameters()))
    assert TINY.n_params() == sum(p.numel() for p in a.parameters())
    assert not list(a.buffers())  # everything the sync moves is a parameter


def test_cached_decode_matches_full_recompute():
    m = _model()
    prompt = torch.randint(TINY.vocab, (3, 7), generator=torch.Generator().manual_seed(1))
    cache = KVCache(TINY, 3, 7 + 9, device="cpu", dtype=torch.float32)
    seq_c, last_c = greedy_decode(m, prompt, 9, cache)
    seq_f, last_f = greedy_decode(m, prompt, 9)
    assert torch.equal(seq_c, seq_f)
    assert seq_c.shape == (3, 16) and torch.equal(seq_c[:, :7], prompt)
    torch.testing.assert_close(last_c, last_f, atol=ATOL, rtol=0)


def test_chunked_prefill_at_an_offset_matches_full_forward():
    m = _model()
    tokens = torch.randint(TINY.vocab, (2, 20), generator=torch.Generator().manual_seed(2))
    cache = KVCache(TINY, 2, 20, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        full = m(tokens)
        a = m(tokens[:, :8], cache, 0)
        b = m(tokens[:, 8:], cache, 8)  # several new tokens at once: causal inside the chunk
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=ATOL, rtol=0)


def test_training_loss_decreases_on_the_synthetic_task():
    from ebbtide.colocate.trainer import train_tokens

    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for step in range(12):
        loss = m.loss(train_tokens(TINY, 4, 32, step, 0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("kw, msg", [
    ({"d_model": 100}, "multiple of 128"),
    ({"vocab": 300}, "multiple of 128"),
    ({"max_seq": 100}, "multiple of 128"),
    ({"n_heads": 5}, "not divisible"),
    ({"n_layers": 0}, "positive int"),
])
def test_bad_config_is_a_clear_error(kw, msg):
    cfg = ModelConfig(**{**TINY.__dict__, **kw})
    with pytest.raises(InvalidArgumentError, match=msg):
        TinyLM(cfg)


def test_decode_argument_errors():
    m = _model()
    prompt = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(InvalidArgumentError, match="too small"):
        greedy_decode(m, prompt, 8, KVCache(TINY, 2, 10, device="cpu", dtype=torch.float32))
    with pytest.raises(InvalidArgumentError, match="new_tokens"):
        greedy_decode(m, prompt, 0)
    with pytest.raises(InvalidArgumentError, match="max_seq"):
        KVCache(TINY, 1, TINY.max_seq + 1, device="cpu", dtype=torch.float32)
    with pytest.raises(InvalidArgumentError, match="max_seq"):
        m(torch.zeros(1, TINY.max_seq + 1, dtype=torch.long))
