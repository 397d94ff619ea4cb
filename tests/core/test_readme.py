"""The README's two set-up commands stay true (CI runs the test command verbatim, the bench command names real
subcommands and options), every relative link in README.md and docs/*.md resolves, and the README stays short."""
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


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def doc_pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*$", page.read_text(), re.M):
        out.add(re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-"))
    return out


def relative_links(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code blocks are code
    for target in LINK.findall(text):
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not files here
            yield target


def test_every_relative_link_resolves():
    broken = []
    for page in doc_pages():
        for target in relative_links(page):
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            rel = f"{page.relative_to(ROOT)} -> {target}"
            if ROOT not in dest.parents and dest != ROOT:
                broken.append(rel + " (outside the repository)")
            elif not dest.exists():
                broken.append(rel + " (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                broken.append(rel + " (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_link_check_sees_links():
    # The check above must find what it checks: the README links every component page.
    targets = set(relative_links(ROOT / "README.md"))
    for page in ("memory", "comm", "quant", "optim", "bench", "settings", "architecture"):
        assert f"docs/{page}.md" in targets, page


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 220
