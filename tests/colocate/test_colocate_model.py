"""The example's model on the CPU: KV-cache decode against the full forward, the static-shape (CUDA-graph) decode
step run eagerly against the eager cached decode, config and argument errors."""
import pytest
import torch

from ebbtide.testing.models import GraphDecoder, KVCache, ModelConfig, TinyLM, greedy_decode
from ebbtide.errors import InvalidArgumentError, UnsupportedError

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
    from ebbtide.bench.colocate.rank import train_tokens

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


# ---- the static-shape decode step (what GraphDecoder captures), run eagerly: the numerics path the graph replays


def _prompt(batch, length, seed=1):
    return torch.randint(TINY.vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cache_batch, fill", [(3, 0.0), (3, float("nan")), (5, float("inf"))])
def test_static_step_decode_matches_eager_cached_decode(cache_batch, fill):
    # fill: what a cache discarded by a pause may hold past the prompt; the static step attends over the whole
    # cache length (masked), so those entries must not leak into the result
    m = _model()
    prompt = _prompt(3, 7)
    seq_e, last_e = greedy_decode(m, prompt, 9, KVCache(TINY, 3, 7 + 9, device="cpu", dtype=torch.float32))
    cache = KVCache(TINY, cache_batch, 7 + 9 + 4, device="cpu", dtype=torch.float32)
    cache.k.fill_(fill)
    cache.v.fill_(fill)
    dec = GraphDecoder(m, cache, 3, capture=False)
    assert dec.mode == "static-eager" and not dec.capture
    seq_s, last_s = dec.generate(prompt, 9)
    assert torch.equal(seq_s, seq_e)
    torch.testing.assert_close(last_s, last_e, atol=ATOL, rtol=0)
    # the decoder is reused across generations (as the captured graph is): a new prompt over the stale cache
    prompt2 = _prompt(3, 5, seed=3)
    seq_e2, last_e2 = greedy_decode(m, prompt2, 6, KVCache(TINY, 3, 11, device="cpu", dtype=torch.float32))
    seq_s2, last_s2 = dec.generate(prompt2, 6)
    assert torch.equal(seq_s2, seq_e2)
    torch.testing.assert_close(last_s2, last_e2, atol=ATOL, rtol=0)


def test_static_step_bf16_matches_eager_decode():
    # the rollout's dtype: argmax equal, logits within two bf16 ulps of the largest
    m = TinyLM.random(TINY, seed=0, dtype=torch.bfloat16)
    prompt = _prompt(2, 6)
    seq_e, last_e = greedy_decode(m, prompt, 8, KVCache(TINY, 2, 14, device="cpu", dtype=torch.bfloat16))
    seq_s, last_s = GraphDecoder(m, KVCache(TINY, 2, 14, device="cpu", dtype=torch.bfloat16), 2,
                                 capture=False).generate(prompt, 8)
    assert torch.equal(seq_s, seq_e)
    assert (last_s - last_e).abs().max().item() <= 2.0 ** -7 * last_e.abs().max().item()


def test_static_step_writes_only_its_position_and_keeps_shapes():
    m = _model()
    cache = KVCache(TINY, 2, 16, device="cpu", dtype=torch.float32)
    before_k, before_v = cache.k.clone(), cache.v.clone()
    shapes = set()
    with torch.no_grad():
        for p in (3, 9):
            out = m.decode_step(torch.tensor([[5], [7]]), torch.tensor([p]), cache)
            shapes.add(tuple(out.shape))
            changed = (cache.k != before_k).any(-1).any(2).any(1).any(0)  # per position
            assert changed.nonzero().flatten().tolist() == ([3] if p == 3 else [3, 9])
            assert (cache.v != before_v).any(-1).any(2).any(1).any(0).nonzero().flatten().tolist() == \
                changed.nonzero().flatten().tolist()
    assert shapes == {(2, TINY.vocab)}


def test_graph_decoder_argument_errors():
    m = _model()
    cache = KVCache(TINY, 2, 12, device="cpu", dtype=torch.float32)
    with pytest.raises(UnsupportedError, match="CUDA device"):
        GraphDecoder(m, cache, 2, capture=True)
    for bad in (0, 3, True, 1.0):
        with pytest.raises(InvalidArgumentError, match="batch"):
            GraphDecoder(m, cache, bad)
    dec = GraphDecoder(m, cache, 2)  # capture defaults to "on a CUDA device": off here
    assert dec.mode == "static-eager"
    with pytest.raises(InvalidArgumentError, match="static batch"):
        dec.generate(torch.zeros(1, 4, dtype=torch.long), 2)
    with pytest.raises(InvalidArgumentError, match="too small"):
        dec.generate(torch.zeros(2, 4, dtype=torch.long), 9)
    with pytest.raises(InvalidArgumentError, match="new_tokens"):
        dec.generate(torch.zeros(2, 4, dtype=torch.long), 0)
