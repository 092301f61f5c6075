"""The project's markdown holds together: every relative link resolves to a file in the tree, and every
benchmark results page is reachable from the README or docs/ (a link or its path in the text), so a
figure the README quotes can be traced to the page that measured it. And no committed page or doc holds
an API key (a benchmark that records a platform's output must leave its ready line's key out)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    found = [ROOT / "README.md"]
    for folder in ("docs", "ops", "k8s", "benchmarks/results"):
        found += sorted((ROOT / folder).rglob("*.md"))
    return found


def relative_links(path: Path) -> list[str]:
    """Link targets in ``path`` that name a file of this tree (not a URL, not an anchor on the same page)."""
    return [t for t in LINK.findall(path.read_text())
            if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_every_relative_link_resolves():
    broken = [f"{path.relative_to(ROOT)}: {target}" for path in markdown_files() for target in relative_links(path)
              if not (path.parent / target.split("#")[0]).exists()]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_the_link_check_sees_links_and_flags_a_missing_file(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [gone](missing.md#part) [web](https://example.com) [here](#top)\n")
    targets = relative_links(page)
    assert targets == ["page.md", "missing.md#part"]
    assert [t for t in targets if not (page.parent / t.split("#")[0]).exists()] == ["missing.md#part"]


def test_every_results_page_is_reachable_from_the_readme_or_docs():
    text = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    pages = sorted(RESULTS.glob("*.md"))
    assert len(pages) > 10, f"only {len(pages)} results pages under {RESULTS}"
    orphans = [p.name for p in pages if f"results/{p.name}" not in text]
    assert not orphans, f"results pages neither linked nor named in README.md or docs/: {orphans}"


KEY_LIKE = re.compile(r"ds-[A-Za-z0-9_-]{40,}")  # a generated API key: ds- + 32 bytes in URL-safe base64


def test_no_committed_page_or_doc_holds_an_api_key():
    from deployments.tenancy.keys import generate_api_key

    assert KEY_LIKE.fullmatch(generate_api_key())  # the pattern finds what the platform generates
    files = markdown_files() + sorted(RESULTS.glob("*.json"))
    found = [f"{path.relative_to(ROOT)}: {m.group(0)[:6]}..." for path in files for m in KEY_LIKE.finditer(path.read_text())]
    assert not found, "API keys in committed pages (a benchmark must not record a platform's ready line as is):\n" + \
        "\n".join(found)
