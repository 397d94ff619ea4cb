"""The colocated loop's option vocabularies live in one module that imports nothing (argument handling stays
light), and every part of the loop takes its words from it."""
import subprocess
import sys


def test_options_import_no_torch():
    code = ("import sys; import ebbtide.bench.colocate.options as o; "
            "assert o.TRAINERS and o.DECODE_MODES; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]", p.stdout


def test_the_loop_takes_its_words_from_the_options():
    from ebbtide.bench.colocate import config, fvariants, launcher, options, rollout, trainer
    from ebbtide.bench.colocate.sync import PLANS

    assert tuple(trainer.VARIANTS) == options.TOY_VARIANTS
    assert tuple(fvariants.VARIANTS) == options.FSDP_VARIANTS
    assert tuple(rollout.MODELS) == options.ARCHS == tuple(PLANS)
    assert {t: v for t, (_m, v) in options.TRAINERS.items()} == {"toy": options.TOY_VARIANTS,
                                                                 "megatron": options.MEGATRON_VARIANTS,
                                                                 "fsdp": options.FSDP_VARIANTS}
    every = options.TOY_VARIANTS + options.MEGATRON_VARIANTS + options.FSDP_VARIANTS
    assert set(options.NEEDS_TMS) <= set(every)
    assert all(t in options.TRAINERS and v in options.TRAINERS[t][1] for t, v in options.PRELOADED_TRAINERS)
    assert all(t in options.TRAINERS for _flag, ts, _why in config.TRAINER_OPTIONS.values() for t in ts)
    assert set(options.STEP_BYTES) == set(options.MOMENTS)
    # each choice the command line offers is the options' tuple
    actions = {a.dest: a for a in launcher._parser()._actions}
    for dest, words in (("decode", options.DECODE_MODES), ("groups", options.GROUP_MODES),
                        ("nccl_cumem", options.CUMEM_MODES), ("moments", options.MOMENTS),
                        ("comm_teardown", options.TEARDOWNS), ("cache_trim", options.CACHE_TRIMS),
                        ("sync_fill", options.SYNC_FILLS), ("scratch_backup", options.SCRATCH_BACKUPS),
                        ("steady_guard", options.STEADY_GUARDS), ("anchor_precision_aware", options.ON_OFF)):
        assert tuple(actions[dest].choices) == words, dest
        assert dest in config.CHOICES and config.CHOICES[dest] == words, dest
