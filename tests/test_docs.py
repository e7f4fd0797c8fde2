"""README is a front door and docs/ holds the rest: every link resolves, every command exists."""

from __future__ import annotations

import re
import shlex

import pytest

from mmcse.cli import main
from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page) -> set[str]:
    body = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", body, re.M)}


def test_readme_is_a_front_door_that_maps_every_docs_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = set(re.findall(r"\(docs/([\w.-]+\.md)[#)]", readme))
    assert linked == {p.name for p in PAGES[1:]}, "README's documentation map and docs/ differ"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.name})")
    assert not broken, f"{page.name}: broken links {broken}"


def _mmcse_commands(page) -> list[list[str]]:
    """The words after ``mmcse`` of every command in the page's bash blocks (shell operators split
    commands; quotes and comments are the shell's)."""
    commands = []
    for lang, block in FENCE.findall(page.read_text()):
        if lang not in ("bash", "sh"):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            command: list[str] = []
            for token in [*lexer, ";"]:
                if token in (";", "&", "&&", "|", "||", "(", ")"):
                    if command[:1] == ["mmcse"]:
                        commands.append(command[1:])
                    command = []
                else:
                    command.append(token)
    return commands


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_mmcse_command_in_a_command_block_exists(page, capsys):
    for words in _mmcse_commands(page):
        subcommands = [w for w in words[:2] if not w.startswith("-")][: 2 if words[:1] == ["figures"] else 1]
        with pytest.raises(SystemExit) as done:
            main([*subcommands, "--help"])
        assert done.value.code == 0, f"{page.name}: `mmcse {' '.join(words)}`: no sub-command {subcommands}"
    capsys.readouterr()


def test_the_checks_catch_a_broken_link_and_an_unknown_command(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nsee [x](missing.md) and [y](#title) and [z](#nowhere)\n")
    with pytest.raises(AssertionError, match=r"missing.md \(no such file\).*#nowhere"):
        test_every_relative_link_resolves(page)
    page.write_text("```bash\nmmcse frobnicate --now\n```\n")
    with pytest.raises(SystemExit) as done:
        main(["frobnicate", "--help"])
    assert done.value.code == 2 and _mmcse_commands(page) == [["frobnicate", "--now"]]
    capsys.readouterr()


def test_the_layout_page_names_every_module():
    """docs/layout.md is checked against the tree: each module of src/mmcse is named on it."""
    layout = (REPO / "docs" / "layout.md").read_text()
    modules = sorted(p for p in (REPO / "src" / "mmcse").rglob("*.py") if p.name != "__init__.py")
    missing = [str(p.relative_to(REPO)) for p in modules if not re.search(rf"\b{re.escape(p.stem)}\b", layout)]
    assert not missing, f"docs/layout.md does not name {missing}"


def test_readme_is_no_lab_notebook():
    """Measured times stand in README rounded, with their machine; dated logs and commit ids go to
    docs/benchmarks.md."""
    readme = (REPO / "README.md").read_text()
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", readme), "a date in README: its log belongs in docs/benchmarks.md"
    commit = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
    assert not commit.findall(FENCE.sub("", readme)), "a commit id in README"
