"""Test support shipped with the package (as DeepGEMM ships ``deep_gemm/testing/``): what the tests and the
benchmark share, so neither reaches into the other.

- :mod:`ebbtide.testing.spawn`: the one fresh-process protocol. ``ranks(fn, world, module=...)`` runs a function on
  N ranks around a store the launcher serves; ``call(fn, *args, module=...)`` runs one function in one process;
  ``command(argv)`` / ``python(code)`` run a program. Results, tracebacks and skips come back as values; deadlines
  kill the process group; each process leaves its log and output under ``$EBBTIDE_TEST_ARTIFACTS``.
- :mod:`ebbtide.testing.ports`: ``free_port()``, a TCP port on loopback.
- :mod:`ebbtide.testing.bits`: bit-level tensor comparison (``same_bits``, ``bits_equal``, ``assert_same_bits``,
  ``digests``) with messages that say where two tensors differ.
- :mod:`ebbtide.testing.models`: the models tests and the bench build (TinyLM and its decoder, the rollout's
  Megatron-shaped GPT, the sync and loader test models).
- :mod:`ebbtide.testing.scenarios`: the comm, DeepEP, Megatron and SGLang scenarios that tests assert on and the
  benchmark measures.

Rules: nothing here imports ``ebbtide.bench`` (the bench imports this package, not the other way round), and the
library itself never imports it: importing ``ebbtide`` or any component loads none of it. Submodules are imported by
name (``from ebbtide.testing import spawn``); this file imports nothing, so ``spawn`` stays free of torch for programs
that must not load it.
"""
