"""docs/settings.md lists every environment variable the sources name: a new EBBTIDE_* or TMS_* variable read
anywhere in the library (Python or native) fails this test until the table has a row for it."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("python", "memory", "comm", "csrc", "optim", "quant")
SUFFIXES = {".py", ".cc", ".h", ".c", ".cu", ".cuh"}
NAME = re.compile(r"\b(?:EBBTIDE|TMS)_[A-Z0-9_]*[A-Z0-9]\b")
HEADER_GUARD = re.compile(r"_(?:H|CUH)_?$")


def compile_time_macros() -> set[str]:
    """Names the build defines for the compiler (csrc/build_info.h.in, cmake/): macros, not environment."""
    names = set(re.findall(r"#define\s+(EBBTIDE_[A-Z0-9_]+)", (ROOT / "csrc" / "build_info.h.in").read_text()))
    for f in (ROOT / "cmake").glob("*.cmake"):
        names |= set(re.findall(r"\b(EBBTIDE_[A-Z0-9_]+)=", f.read_text()))
    return names


def names_in_sources() -> dict[str, str]:
    macros = compile_time_macros()
    found: dict[str, str] = {}
    for d in SOURCE_DIRS:
        for f in sorted((ROOT / d).rglob("*")):
            if f.suffix not in SUFFIXES or not f.is_file():
                continue
            for name in NAME.findall(f.read_text(errors="replace")):
                if HEADER_GUARD.search(name) or name in macros:
                    continue
                found.setdefault(name, str(f.relative_to(ROOT)))
    return found


def documented() -> set[str]:
    text = (ROOT / "docs" / "settings.md").read_text()
    return set(re.findall(r"`((?:EBBTIDE|TMS)_[A-Z0-9_]+)`", text))


def test_scan_finds_known_settings():
    # The scan itself must work: these are read in Python, in the core and in the memory engine.
    found = names_in_sources()
    for name in ("EBBTIDE_COMM_TIMEOUT", "EBBTIDE_DEBUG", "EBBTIDE_MEM_CHUNK_BYTES", "TMS_INIT_ENABLE"):
        assert name in found, name
    assert not any(HEADER_GUARD.search(n) for n in found)


def test_every_setting_in_the_sources_is_documented():
    missing = {n: f for n, f in names_in_sources().items() if n not in documented()}
    assert not missing, "add these to docs/settings.md (name, type, default, meaning, component): " + ", ".join(
        f"{n} ({f})" for n, f in sorted(missing.items()))


def test_no_documented_setting_is_stale():
    # Every run-time row names a variable some source still reads (build-time and test rows are checked elsewhere).
    text = (ROOT / "docs" / "settings.md").read_text()
    run_time = text.split("## Run time", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `((?:EBBTIDE|TMS)_[A-Z0-9_]+)`", run_time, re.M))
    assert rows, "docs/settings.md lost its run-time table"
    stale = rows - set(names_in_sources())
    assert not stale, f"docs/settings.md documents variables no source reads: {sorted(stale)}"
