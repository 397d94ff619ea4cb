"""pip entry point: builds the native targets with CMake (all flags and sources live in CMakeLists.txt).

Environment knobs: EBBTIDE_CUDA=AUTO|ON|OFF, EBBTIDE_CUDA_ARCHS (default "80-real;86-real;89-real;90-real;90-virtual",
or e.g. "90-real" or "native"), EBBTIDE_BUILD_TYPE (Release), EBBTIDE_BUILD_JOBS (parallel jobs), CMAKE_ARGS (extra -D
flags). The build's CUDA decision (nvcc found or not, which architectures) is one line, shown even where pip hides
the build's output (docs/install.md).
"""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def tell_user(line: str) -> None:
    """Print ``line`` and, where pip captures this process's output (it shows a successful build's output only with
    -v), also write it to the terminal pip runs in, if there is one: the one line a user must see (whether nvcc was
    found and which GPUs get code) would otherwise be hidden."""
    print(line, flush=True)
    if sys.stdout.isatty():
        return
    try:
        fd = os.open("/dev/tty", os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:  # no controlling terminal (CI, containers): the line is in the build log
        return
    try:
        os.write(fd, (line + "\n").encode())
    except OSError:
        pass
    finally:
        os.close(fd)


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        # The package directory that will hold _C, libebbtide.so and friends (the source tree for -e installs).
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        out_dir.mkdir(parents=True, exist_ok=True)
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        import pybind11

        cfg = os.environ.get("EBBTIDE_BUILD_TYPE", "Release")
        args = [
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DEBBTIDE_OUTPUT_DIR={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DEBBTIDE_CUDA={os.environ.get('EBBTIDE_CUDA', 'AUTO')}",
        ]
        if os.environ.get("EBBTIDE_CUDA_ARCHS"):
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ['EBBTIDE_CUDA_ARCHS']}")
        try:
            subprocess.run(["ninja", "--version"], check=True, capture_output=True)
            args.append("-GNinja")
        except (OSError, subprocess.CalledProcessError):
            pass
        args += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        # pip's isolated build environments are temporary: a cache configured in an earlier one points at tools
        # that no longer exist. Reconfigure from scratch whenever the tools or options changed.
        stamp = build_dir / "ebbtide-configure.stamp"
        fingerprint = "\n".join([shutil.which("cmake") or "", shutil.which("ninja") or "", *args])
        if stamp.exists() and stamp.read_text() != fingerprint:
            shutil.rmtree(build_dir)
            build_dir.mkdir(parents=True)
        jobs = os.environ.get("EBBTIDE_BUILD_JOBS") or str(os.cpu_count() or 2)
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args], check=True)
        stamp.write_text(fingerprint)
        summary = build_dir / "ebbtide-build-summary.txt"
        if summary.exists():
            tell_user(summary.read_text().strip() + f" -- building with {jobs} jobs")
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel", jobs], check=True)
        self._companions = sorted(p for p in out_dir.glob("*.so") if p.name.startswith("lib"))

    def copy_extensions_to_source(self) -> None:
        # Editable installs build into build_lib and copy only the extension back; the runtime library (and
        # any test library) beside it must come along, or _C cannot find libebbtide.so through $ORIGIN.
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        package_dir = Path(build_py.get_package_dir("ebbtide"))
        for lib in getattr(self, "_companions", []):
            self.copy_file(str(lib), str(package_dir / lib.name), level=self.verbose)


setup(
    ext_modules=[CMakeExtension("ebbtide._C")],
    cmdclass={"build_ext": CMakeBuild},
)
