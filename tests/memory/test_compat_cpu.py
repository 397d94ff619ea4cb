"""ebbtide.compat.torch_memory_saver on CPU: the sys.path switch, the surface compared with the real package's
source (when its wheel is at hand: EBBTIDE_TMS_WHEEL or <repo>/.whl), configure_subprocess, refusals. The
scenarios themselves need a GPU (test_compat_gpu.py)."""
from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ebbtide.compat
from ebbtide import _native
from ebbtide.compat import torch_memory_saver as ours
from ebbtide.errors import InvalidArgumentError
from ebbtide.testing import spawn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tms_reference  # noqa: E402

FAKE = _native.PACKAGE_DIR / "libebbtide_fake_cuda.so"


def _python(code: str, **env_extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",)}
    env.update(env_extra)
    return spawn.python(code, env=env, timeout=120, check=False)


def test_shim_path_serves_our_module_under_the_original_name():
    out = subprocess.run([sys.executable, "-m", "ebbtide.compat", "--shim-path"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == ebbtide.compat.shim_path(), out
    path = os.pathsep.join([ebbtide.compat.shim_path(), os.environ.get("PYTHONPATH", "")])
    p = _python("import torch_memory_saver as t\n"
                "from torch_memory_saver import torch_memory_saver, configure_subprocess, TorchMemorySaver\n"
                "import ebbtide.compat.torch_memory_saver as e\n"
                "assert torch_memory_saver is e.torch_memory_saver and TorchMemorySaver is e.TorchMemorySaver\n"
                "assert configure_subprocess is e.configure_subprocess\n"
                "print('OK')", PYTHONPATH=path)
    assert p.returncode == 0 and p.stdout.strip() == "OK", p.stdout + p.stderr


def _their_surface(source: str):
    """{name: ("method", [(param, default-repr)...]) | ("property", has_setter)} of their TorchMemorySaver."""
    tree = ast.parse(source)
    consts = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}

    def value(d):
        return consts[d.id] if isinstance(d, ast.Name) else ast.literal_eval(d)

    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TorchMemorySaver")
    out = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
            continue
        decos = [ast.unparse(d) for d in fn.decorator_list]
        if "property" in decos:
            out.setdefault(fn.name, ("property", False))
        elif any(d.endswith(".setter") for d in decos):
            out[fn.name] = ("property", True)
        else:
            args = fn.args.args[1:]
            defaults = [None] * (len(args) - len(fn.args.defaults)) + list(fn.args.defaults)
            out[fn.name] = ("method", [(a.arg, None if d is None else value(d)) for a, d in
                                       zip(args, defaults)])
    return out


@pytest.mark.skipif(tms_reference.wheel() is None, reason="torch_memory_saver wheel not found (EBBTIDE_TMS_WHEEL)")
def test_surface_matches_the_real_package():
    theirs = _their_surface(tms_reference.entrypoint_source())
    assert {"region", "cuda_graph", "disable", "pause", "resume", "hook_mode", "memory_margin_bytes",
            "get_cpu_backup"} <= set(theirs), sorted(theirs)
    for name, (kind, detail) in theirs.items():
        attr = inspect.getattr_static(ours.TorchMemorySaver, name, None)
        assert attr is not None, f"missing {name}"
        if kind == "property":
            assert isinstance(attr, property), name
            assert not detail or attr.fset is not None, f"{name} needs a setter"
            continue
        params = list(inspect.signature(attr).parameters.values())[1:]
        got = [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params]
        assert got == detail, f"{name}: ours {got} vs theirs {detail}"


def test_configure_subprocess_prepends_and_restores(monkeypatch):
    lib = _native.runtime_library_path()
    monkeypatch.setenv("LD_PRELOAD", "/other/lib.so")
    with ours.configure_subprocess():
        parts = os.environ["LD_PRELOAD"].split(":")
        assert parts[0] == lib and "/other/lib.so" in parts
    assert os.environ["LD_PRELOAD"] == "/other/lib.so"
    monkeypatch.delenv("LD_PRELOAD")
    with ours.torch_memory_saver.configure_subprocess():
        assert os.environ["LD_PRELOAD"] == lib
    assert "LD_PRELOAD" not in os.environ


def test_refusals_change_nothing():
    tms = ours.torch_memory_saver
    with pytest.raises(InvalidArgumentError, match="mutually exclusive"):
        with tms.region("x", enable_cpu_backup=True, enable_disk_backup=True):
            pass
    with pytest.raises(InvalidArgumentError, match="requires enable_cpu_backup"):
        with tms.region("x", cpu_backup_backend="pinned"):
            pass
    with pytest.raises(InvalidArgumentError, match="cpu_backup_backend"):
        with tms.region("x", enable_cpu_backup=True, cpu_backup_backend="disk"):
            pass
    with pytest.raises(InvalidArgumentError, match="hook_mode"):
        tms.hook_mode = "ld_preload"
    assert tms.enabled is True


def test_disk_directory_on_tmpfs_refused_by_name(tmp_path):
    shm = "/dev/shm"
    with open("/proc/mounts") as f:
        if not any(line.split()[1] == shm and line.split()[2] == "tmpfs" for line in f):
            pytest.skip("/dev/shm is not tmpfs here")
    target = os.path.join(shm, f"ebbtide-compat-{os.getpid()}")
    try:
        with pytest.raises(InvalidArgumentError, match="tmpfs"):
            ours.torch_memory_saver.set_disk_backup_dir(target)
    finally:
        os.rmdir(target) if os.path.isdir(target) else None
    real = tmp_path / "backups"
    ours.torch_memory_saver.set_disk_backup_dir(str(real))  # created; a real disk (unless tmp is tmpfs)
    import ebbtide.memory as em  # noqa: PLC0415

    assert em.disk_backup_dir() == str(real)


@pytest.mark.skipif(not FAKE.exists(), reason="fake driver not built")
def test_pause_resume_of_unknown_tags_are_noops_and_margin_round_trips():
    p = _python("from ebbtide.compat.torch_memory_saver import torch_memory_saver as t\n"
                "import ebbtide.memory as em\n"
                "t.pause('never-used'); t.resume('never-used'); t.pause(); t.resume()\n"
                "t.memory_margin_bytes = 1 << 30\n"
                "assert em.memory_margin() == 1 << 30 and t.memory_margin_bytes == 1 << 30\n"
                "t.retain_cpu_backup = False\n"
                "assert t.retain_cpu_backup is False\n"
                "print('OK')", EBBTIDE_LIBCUDA=str(FAKE))
    assert p.returncode == 0 and p.stdout.strip() == "OK", p.stdout + p.stderr
