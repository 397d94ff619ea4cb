"""GPU scenario: the rollout's CUDA-graph decode under the LD_PRELOAD shim, paused and resumed (run by
test_colocate_gpu.py in a process of its own: ``python graph_decode_scenario.py``; prints "OK" at the end).

The decode graph is captured with ``ebbtide.memory.graph(tag="kv_cache", backup="none")`` as the ebbtide rollout
does. Checked: the capture lands in the engine's tag; pause releases it (and the cache) from the device; after the
resume, replay gives the eager decode's tokens again, also when the cache comes back holding NaN (a discarded
cache's content is undefined; EBBTIDE_MEM_POISON=1 makes it 0xA5 bytes); one replay with fixed inputs gives the
same logits bit for bit before the first pause and after every resume; repeated cycles do not grow memory.
fp32, so the captured step and the eager decode agree to ~1e-6 and the tokens must be equal.
"""
from __future__ import annotations

import sys

import torch

import ebbtide.memory as em
from ebbtide.testing.models import GraphDecoder, KVCache, ModelConfig, TinyLM, greedy_decode

MiB = 1 << 20
CFG = ModelConfig(vocab=1024, d_model=256, n_layers=4, n_heads=4, d_ff=512, max_seq=256)
B, P, N = 4, 24, 40


def used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def tag_active(tag: str) -> int:
    return sum(r["bytes_active"] for r in em.stats()["tags"] if r["tag"] == tag)


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: no CUDA GPU")
        return 0
    assert em.hook_mode() == "preload", "run under ebbtide.memory.preload_env()"
    with em.region("weights", backup="cpu"):
        model = TinyLM.random(CFG, seed=0, device="cuda", dtype=torch.float32)
    with em.region("kv_cache"):
        cache = KVCache(CFG, B, P + N, device="cuda", dtype=torch.float32)
    prompt_cpu = torch.randint(CFG.vocab, (B, P), generator=torch.Generator().manual_seed(1))
    ref_seq, ref_last = greedy_decode(model, prompt_cpu.cuda(), N, KVCache(CFG, B, P + N, device="cuda",
                                                                           dtype=torch.float32))
    ref_seq, ref_last = ref_seq.cpu(), ref_last.cpu()  # host copies: the default tag is paused below too

    before = tag_active("kv_cache")
    with em.region("kv_cache"):
        dec = GraphDecoder(model, cache, B, graph_context=lambda g, s: em.graph(g, tag="kv_cache", backup="none",
                                                                                  stream=s))

    def check(what: str):
        seq, last = dec.generate(prompt_cpu.cuda(), N)
        assert torch.equal(seq.cpu(), ref_seq), f"{what}: tokens differ from the eager decode"
        diff = (last.cpu() - ref_last).abs().max().item()
        assert diff <= 1e-3, f"{what}: last logits differ by {diff}"
        print(f"{what}: tokens equal, last logits max |diff| {diff:.2e}", flush=True)

    check("first generate (captures)")
    assert dec.graph is not None and dec.graph_bytes > 0
    grew = tag_active("kv_cache") - before
    print(f"graph {dec.graph_bytes / MiB:.1f} MiB (torch reserved), kv_cache tag grew {grew / MiB:.1f} MiB")
    assert grew >= dec.graph_bytes, "the capture did not land in the kv_cache tag"
    # One replay with fixed inputs (token, position, the whole cache) before any pause: every replay after a
    # pause/resume cycle must give these logits bit for bit (same graph, same addresses, same bits in and out).
    pattern = torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(5)).to(cache.k.dtype)

    def replay_fixed():
        cache.k.copy_(pattern)
        cache.v.copy_(pattern.flip(-1))
        dec.token.fill_(3)
        dec.pos.fill_(P + 5)
        dec.graph.replay()
        return dec.logits.clone()

    fixed = replay_fixed()
    marks = []
    for cycle in range(4):
        torch.cuda.empty_cache()
        u0 = used()
        em.pause(None)
        u1 = used()
        assert tag_active("kv_cache") == 0
        assert u0 - u1 >= cache.nbytes + dec.graph_bytes, f"pause freed only {(u0 - u1) / MiB:.1f} MiB"
        em.resume(None)
        if cycle == 2:  # undefined content past the prompt must not leak through the mask
            cache.k.fill_(float("nan"))
            cache.v.fill_(float("nan"))
        check(f"after pause/resume {cycle + 1}")
        assert torch.equal(replay_fixed(), fixed), f"cycle {cycle + 1}: the replay's logits changed"
        torch.cuda.empty_cache()
        marks.append(used())
    assert max(marks) - min(marks) <= 16 * MiB, f"memory grew over the cycles: {marks}"
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
