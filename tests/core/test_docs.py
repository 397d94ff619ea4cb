"""The documentation holds together: every relative link in README.md and docs/**/*.md resolves to a file (and a
link into a page's heading to that heading), the README links every page, and the split holds — reference pages
carry no dated runs (those live in docs/results.md and the raw files under docs/bench-results/), and neither do the
docstrings and comments of the sources."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results.md"
RAW = DOCS / "bench-results"
# Sources whose docstrings and comments must carry no run dates (design notes, NOTES.md, are documents).
SOURCE_DIRS = ("python/ebbtide", "memory", "quant", "optim", "csrc", "comm")
SOURCE_SUFFIXES = {".py", ".cc", ".h", ".cu", ".cuh", ".cpp"}
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def reference_pages() -> list[Path]:
    """Every page but the results log and the raw files' index."""
    return [p for p in doc_pages() if p != RESULTS and RAW not in p.parents]


def prose(page: Path) -> str:
    """The page without its code blocks (a '#' line in a code block is no heading, a link there is code)."""
    return FENCE.sub("", page.read_text())


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but '-' and '_' dropped, spaces to hyphens; a repeated id
    gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose(page), re.M):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(page: Path):
    for target in LINK.findall(prose(page)):
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


def test_link_check_sees_links_and_headings():
    # The checks above must find what they check.
    targets = set(relative_links(ROOT / "README.md"))
    assert "docs/memory.md" in targets and "docs/results.md" in targets, sorted(targets)
    assert "the-megatron-trainer---trainer-megatron" in anchors(DOCS / "colocate.md")
    assert not any(a.startswith("trainer-process") for a in anchors(DOCS / "sync.md"))  # a '#' in a code block


def test_readme_links_every_page():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(ROOT / "README.md")}
    missing = [str(p.relative_to(ROOT)) for p in reference_pages()[1:] + [RESULTS] if p.resolve() not in linked]
    assert not missing, f"pages the README does not link: {missing}"


def test_dated_runs_live_in_the_results_log():
    dated = {str(p.relative_to(ROOT)): len(DATE.findall(p.read_text())) for p in reference_pages()}
    dated = {p: n for p, n in dated.items() if n}
    assert not dated, f"dated runs outside docs/results.md (move them there): {dated}"
    assert len(DATE.findall(RESULTS.read_text())) > 50  # the log is where they went


def test_sources_carry_no_run_dates():
    hits = []
    for d in SOURCE_DIRS:
        for f in sorted((ROOT / d).rglob("*")):
            if f.suffix in SOURCE_SUFFIXES and f.is_file():
                for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                    if DATE.search(line):
                        hits.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "dates in sources (run figures belong in docs/results.md):\n" + "\n".join(hits)


def test_results_log_links_its_raw_files():
    raw = [t for t in relative_links(RESULTS) if t.startswith("bench-results/")]
    assert len(raw) > 20, "docs/results.md links the raw JSON of its runs"
