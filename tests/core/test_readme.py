"""The README's two set-up commands stay true: CI runs the test command verbatim, and the bench command names
real subcommands and options."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    lines = [ln.split("#")[0].strip() for ln in block.strip().splitlines()]
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
