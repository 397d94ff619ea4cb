"""Scenarios that the tests and the benchmark both run, each inside fresh processes started by
:mod:`ebbtide.testing.spawn`: ``comm`` (release/reload cycles of process groups beside plain destroy + re-create),
``deepep`` (Megatron's DeepEP buffer through release/reload), ``megatron_gpt`` (a Megatron-core GPT on one GPU:
the setup the benchmark times and the exactness scenarios the GPU tests assert), ``sglang_served`` (SGLang's own
layers as a served model, loaded by SGLang's own ``load_weights``)."""
