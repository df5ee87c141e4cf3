"""The documentation against the code (issue 33): every config key is in docs/config.md's table,
every relative link (and #anchor) of the README and docs/ resolves, and the README stays what a
newcomer reads first, with the test command CI runs."""

import dataclasses
import re
from pathlib import Path

import pytest

from rwkvx_cli.config import Config

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "data" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", prose(page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def test_every_config_key_is_in_docs_config():
    documented = set()
    for row in (REPO / "docs" / "config.md").read_text().splitlines():
        if row.startswith("| `"):
            names = re.findall(r"`([^`]+)`", row.split("|")[1])
            section = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
            documented |= {names[0], *(f"{section}.{n}" for n in names[1:])}
    cfg = Config()
    keys = {f.name for f in dataclasses.fields(cfg) if not dataclasses.is_dataclass(getattr(cfg, f.name))}
    for part in ("model", "data", "train"):
        keys |= {f"{part}.{f.name}" for f in dataclasses.fields(getattr(cfg, part))}
    assert keys <= documented, f"undocumented in docs/config.md: {sorted(keys - documented)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if "shared" in Path(path).parts or not dest.exists() or REPO not in dest.parents:
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_the_readme_is_short_and_keeps_the_test_command_ci_runs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M)
    assert re.search(r"^make test\b", readme, flags=re.M)  # the quickstart's command
    for page in ("docs/cli.md", "docs/config.md"):
        assert f"]({page})" in readme
