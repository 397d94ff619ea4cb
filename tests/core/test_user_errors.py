"""Errors in the user's words: a typed error names the setting or argument, the value, what is accepted and what to
do; no native call signature in a message (it goes to the debug log); every EBBTIDE_* setting fails where its
component is imported or installed; `ebbtide info` reports a bad setting beside everything else."""
import json
import os
import re
import subprocess

import pytest

from ebbtide import settings
from ebbtide.errors import InvalidArgumentError, SettingError
from ebbtide.testing import spawn

NATIVE_CALL = re.compile(r"\bebt_\w+\(|\w+::\w+\(|\(&\w")  # ebt_x(...), Class::method(...), (&out


def _py(code: str, env: dict) -> subprocess.CompletedProcess:
    return spawn.python(code, extra_env=env, timeout=120, check=False)


def test_a_native_error_carries_the_users_words_and_logs_the_call():
    from ebbtide import _native

    C = _native.load()
    with pytest.raises(InvalidArgumentError) as e:
        C.host_stream_bandwidth(9, 1, 0, 0, 0, 4096)
    assert str(e.value) == "each stream count must be in [0, 4], got 9" and not NATIVE_CALL.search(str(e.value))
    p = _py("from ebbtide import _native\ntry:\n    _native.load().host_stream_bandwidth(9, 1, 0, 0, 0, 4096)\n"
            "except Exception as e:\n    print('MSG', e)", {"EBBTIDE_DEBUG": "INFO"})
    assert "MSG each stream count must be in [0, 4], got 9" in p.stdout, p.stdout + p.stderr
    assert "ebt_host_stream_bandwidth failed" in p.stderr, p.stderr  # the call: debug log only


@pytest.mark.parametrize("module, var, value, accepted", [
    ("ebbtide.memory", "EBBTIDE_MEM_COALESCE", "maybe", "1/true/yes/on or 0/false/no/off"),
    ("ebbtide.memory", "EBBTIDE_MEM_CHECK", "sometimes", "1/true/yes/on or 0/false/no/off"),
    ("ebbtide.optim", "EBBTIDE_CPU_ISA", "bogus", "one of avx512_bf16, avx512, avx2"),
    ("ebbtide.optim", "EBBTIDE_ADAM_TASKS_PER_THREAD", "many", "an integer"),
    ("ebbtide.quant", "EBBTIDE_QUANT_KERNELS", "fastest", "one of"),
])
def test_a_bad_setting_fails_at_the_import_of_its_component(module, var, value, accepted):
    p = _py(f"import {module}", {var: value})
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ebbtide.errors.SettingError: {var}='{value}' is not a valid setting: expected "), last
    assert accepted in last and f"fix it, or unset {var} for the default" in last, last
    assert not NATIVE_CALL.search(last), last


@pytest.mark.parametrize("var, value, accepted", [
    ("EBBTIDE_COMM_TIMEOUT", "abc", "a number > 0"),
    ("EBBTIDE_COMM_WARMUP", "fast", "one of serial, concurrent, off"),
])
def test_a_bad_comm_setting_fails_at_install(monkeypatch, var, value, accepted):
    import ebbtide.comm as comm

    monkeypatch.setenv(var, value)
    settings.reset()
    try:
        with pytest.raises(SettingError) as e:
            comm.install()
    finally:
        monkeypatch.delenv(var)
        settings.reset()
    assert e.value.name == var and e.value.value == value
    assert accepted in str(e.value) and f"unset {var} for the default" in str(e.value)


def test_problems_names_every_bad_setting_and_raises_nothing(monkeypatch):
    monkeypatch.setenv("EBBTIDE_COMM_TIMEOUT", "abc")
    monkeypatch.setenv("EBBTIDE_BENCH_MEMORY_ROWS", "some")
    settings.reset()
    try:
        names = {e.name for e in settings.problems()}
    finally:
        monkeypatch.undo()
        settings.reset()
    assert {"EBBTIDE_COMM_TIMEOUT", "EBBTIDE_BENCH_MEMORY_ROWS"} <= names
    assert settings.problems() == []


def test_every_declaring_module_is_listed():
    # problems() imports DECLARING_MODULES to see every Python setting: a module that declares one must be there
    # (test support, ebbtide.testing, excepted: it reads its own settings where it uses them)
    root = os.path.join(os.path.dirname(settings.__file__))
    declaring, testing_names, library_names = set(), set(), set()
    for d, _, files in os.walk(root):
        for f in files:
            text = open(os.path.join(d, f)).read() if f.endswith(".py") else ""
            if "settings.declare(" not in text:
                continue
            rel = os.path.relpath(os.path.join(d, f[:-3]), os.path.dirname(root))
            module = rel.replace(os.sep, ".").removesuffix(".__init__")
            if module.startswith("ebbtide.testing."):
                testing_names |= set(re.findall(r'settings\.declare\(\s*"(\w+)"', text))
            else:
                declaring.add(module)
                library_names |= set(re.findall(r'settings\.declare\(\s*"(\w+)"', text))
    assert declaring == set(settings.DECLARING_MODULES)
    listed = {n for names, _ in settings.COMPONENTS.values() for n in names}
    assert len(library_names) >= 7 and not testing_names & listed
    unlisted = library_names - listed
    assert not unlisted, f"add to a component of settings.COMPONENTS (checked where it is installed): {unlisted}"


def test_info_reports_a_bad_setting_instead_of_refusing():
    p = _py("import sys; from ebbtide.cli import main; sys.exit(main(['info']))", {"EBBTIDE_CPU_ISA": "bogus"})
    assert "CPU ISA          : unknown" in p.stdout and "torch            :" in p.stdout, p.stdout + p.stderr
    assert "BAD SETTING      : EBBTIDE_CPU_ISA='bogus' is not a valid setting" in p.stdout
    set_line = next(line for line in p.stdout.splitlines() if line.startswith("  settings set     : "))
    assert "EBBTIDE_CPU_ISA='bogus'" in set_line, set_line  # beside whatever else the caller set (CI: build jobs)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "EBBTIDE_CPU_ISA" in p.stderr
    j = _py("import sys; from ebbtide.cli import main; sys.exit(main(['info', '--json']))",
            {"EBBTIDE_CPU_ISA": "bogus"})
    doc = json.loads(j.stdout)
    assert [p["name"] for p in doc["settings_problems"]] == ["EBBTIDE_CPU_ISA"] and doc["cpu"]["isa"] == "unknown"


def test_bench_refuses_a_bad_setting_before_any_suite():
    p = _py("import sys; from ebbtide.cli import main; sys.exit(main(['bench', 'limits', '--quick']))",
            {"EBBTIDE_COMM_WARMUP": "fast"})
    assert p.returncode == 2 and "EBBTIDE_COMM_WARMUP='fast'" in p.stderr and "nothing was run" in p.stderr
    assert "== suite" not in p.stderr and "Traceback" not in p.stderr


def test_cpu_adam_names_the_isa_it_accepts():
    torch = pytest.importorskip("torch")
    from ebbtide.optim import CPUAdam

    with pytest.raises(InvalidArgumentError) as e:
        CPUAdam([torch.zeros(4)], isa="bogus")
    msg = str(e.value)
    assert msg.startswith("isa='bogus' is not a CPU Adam kernel: expected one of avx512_bf16") and "None" in msg
    assert not NATIVE_CALL.search(msg), msg
