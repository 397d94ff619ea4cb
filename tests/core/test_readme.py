"""The README stays a front door: its two set-up commands stay true (CI runs the test command verbatim, the bench
command names real subcommands and options), its headline table is at most ten one-line rows of five columns, and
the whole file stays small (bytes, not lines: a line-count bound is met by making rows wider)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_BYTES = 8 * 1024
HEADLINE_COLUMNS = ["capability", "ebbtide", "anchor", "ratio", "machine"]
MAX_ROWS = 10
MAX_ROW_CHARS = 160


def readme_commands():
    """The bash block holding the two commands (the benchmark suite, the tests): the one that runs pytest."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    found = [b for b in blocks if "pytest" in b]
    assert len(found) == 1, f"one bash block of the README runs pytest, found {len(found)}"
    lines = [ln.split("#")[0].strip() for ln in found[0].strip().splitlines()]
    assert len(lines) == 2, lines
    return lines


def test_ci_runs_the_readme_test_command():
    bench_cmd, test_cmd = readme_commands()
    assert "pytest" in test_cmd
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


def test_readme_bench_command_parses():
    from ebbtide.cli import build_parser

    bench_cmd, _ = readme_commands()
    argv = bench_cmd.split("&&")[1].split()
    assert argv[0] == "ebbtide"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "bench" and args.json and args.plot


def test_readme_install_line_keeps_the_users_torch():
    # The first command a reader meets installs into their environment without replacing torch.
    first = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    commands = [ln.split("#")[0].strip() for ln in first.splitlines()]
    assert "pip install --no-build-isolation ." in commands, commands
    assert not any("torch" in c for c in commands), commands


def headline_rows():
    text = README.read_text()
    section = re.search(r"^## Headline figures\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README has a '## Headline figures' section"
    table = [ln for ln in section.group(1).splitlines() if ln.startswith("|")]
    assert len(table) >= 2, "the headline section holds a table"
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == HEADLINE_COLUMNS, header
    assert re.fullmatch(r"\|(\s*:?-+:?\s*\|){5}", table[1]), table[1]
    return table[2:]


def test_headline_rows_are_one_line_of_five_columns():
    rows = headline_rows()
    assert 1 <= len(rows) <= MAX_ROWS, f"{len(rows)} headline rows (at most {MAX_ROWS})"
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert len(cells) == 5 and all(cells), f"five non-empty cells: {row}"
        assert len(row) <= MAX_ROW_CHARS, f"a headline row of {len(row)} characters (at most {MAX_ROW_CHARS}): {row}"
        assert not re.search(r"20\d\d-\d\d|\b\d\d-\d\d\b", row), f"dates belong in docs/results.md: {row}"


def test_readme_stays_small():
    n = len(README.read_bytes())
    assert n <= MAX_BYTES, f"README.md is {n} bytes (at most {MAX_BYTES}): detail belongs in docs/"
