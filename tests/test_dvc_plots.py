"""`dvc plots show` / `dvc plots diff` render every plot dvc.yaml declares, with no network access.

The repo's ``.dvc/config`` points ``plots.html_template`` at ``vendor/vega/template.html``, which inlines
vega, vega-lite and vega-embed (vendor/vega/README.md). Each test builds a small git+DVC repo holding the
repo's dvc.yaml, params.yaml, .dvc/config and that template, writes every declared plot file (CSV rows with
the declared x/y columns, tiny PNGs), and runs the installed DVC on it.

"References no remote URL" means, precisely: opening the page makes the browser fetch nothing over the
network. So the assertions are on fetch targets, not on every byte of the page:
  * no element attribute that makes a browser load something (src, href, srcset, poster, data, action,
    background, xlink:href, a meta refresh URL) is an http(s) or protocol-relative (``//host``) URL;
  * every <script> is inline (no ``src``), and no script or style imports a remote URL (``import ... from
    "https://..."``, ``import("https://...")``, CSS ``@import`` / ``url(https://...)``);
  * the vega specs carry their data inline (``data.values``): no ``url`` key anywhere in a spec, which
    vega's loader would fetch;
  * vega-embed's "Open in Vega Editor" action (it posts the spec to a web page) is turned off.
Strings inside the vendored libraries (licence banners, the SVG namespace, the ``$schema`` identifier
every vega-lite spec carries, which nothing fetches) are not fetch targets and are not asserted on.
Where a Chromium is installed, the page is also opened with every host name unresolvable and each vega
chart must have drawn its marks.
"""

from __future__ import annotations

import configparser
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
VEGA_EXT = {".csv", ".tsv", ".json", ".yaml", ".yml"}
IMAGE_EXT = {".png", ".jpg", ".jpeg", ".gif", ".svg"}
# What dvc.yaml declares today; the test reads dvc.yaml itself, this only guards that reading.
KNOWN = {"plots/train_loss.csv", "plots/dev.csv", "plots/dev_geometry.csv",
         "plots/geometry_trajectory.png", "plots/sts_scatter.png", "plots/tsne.png", "plots/ablation.png",
         "plots/kdmcse_threshold.png"}
VENDORED = ("vega", "vega-lite", "vega-embed")
# The UMD global each vendored build assigns (``(globalThis).vega = ...`` once minified).
GLOBALS = {"vega": r"\.vega\s*=", "vega-lite": r"\.vegaLite\s*=", "vega-embed": r"\.vegaEmbed\s*="}
# Any URL with an authority part: http(s)://, ftp://, protocol-relative //host, and file:// too (an absolute
# local URL would tie the page to one machine; relative paths and data: URLs are what a standalone page uses).
REMOTE = re.compile(r"^\s*(?:[a-z][a-z0-9+.-]*:)?//", re.IGNORECASE)
FETCH_ATTRS = {"src", "href", "srcset", "poster", "data", "action", "formaction", "background", "xlink:href"}
SCRIPT_IMPORT = re.compile(r"""\bimport\s*(?:\(\s*|[\w${},*\s]+\bfrom\s*)["'`]\s*(?:[a-z][a-z0-9+.-]*:)?//""",
                           re.IGNORECASE)
CSS_IMPORT = re.compile(r"""@import\s+(?:url\()?\s*["']?\s*(?:[a-z][a-z0-9+.-]*:)?//|url\(\s*["']?\s*"""
                        r"""(?:[a-z][a-z0-9+.-]*:)?//""", re.IGNORECASE)
SPEC = re.compile(r"var spec = (\{.*?\});\s*vegaEmbed\('#([^']+)', spec\);", re.DOTALL)


# ----------------------------------------------------------------------------------------------- helpers
def declared_plots() -> dict[str, dict]:
    """{path: properties} of every plot in dvc.yaml: each stage's ``plots`` and the top-level list."""
    spec = yaml.safe_load((REPO / "dvc.yaml").read_text())
    entries = [p for stage in spec["stages"].values() for p in stage.get("plots", [])]
    entries += spec.get("plots", [])
    plots: dict[str, dict] = {}
    for entry in entries:
        items = [(entry, {})] if isinstance(entry, str) else list(entry.items())
        for path, props in items:
            suffix = Path(path).suffix.lower()
            assert suffix in VEGA_EXT | IMAGE_EXT, (
                f"dvc.yaml plot {path!r} is not a plot file this test knows how to write: extend the test")
            plots[path] = props or {}
    return plots


def dvc(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DVC_NO_ANALYTICS="1")
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"dvc {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    assert "failed to load" not in proc.stderr + proc.stdout, proc.stderr
    return proc


def git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid",
                           "-c", "commit.gpgsign=false", *args], cwd=repo, check=True, capture_output=True, text=True)


def template_path() -> Path:
    """The template ``.dvc/config`` names (relative paths there are relative to .dvc/, as DVC reads them)."""
    cfg = configparser.ConfigParser()
    cfg.read_string((REPO / ".dvc" / "config").read_text())
    assert cfg.has_option("plots", "html_template"), ".dvc/config sets no plots.html_template"
    path = (REPO / ".dvc" / cfg.get("plots", "html_template")).resolve()
    assert path.is_file(), f".dvc/config: plots.html_template {path} does not exist"
    assert path.is_relative_to(REPO), f"plots.html_template {path} lies outside the repository"
    return path


def write_plots(repo: Path, plots: dict[str, dict], scale: float) -> dict[str, object]:
    """Write every declared plot file; return what each holds (CSV rows / PNG bytes) for the checks."""
    written: dict[str, object] = {}
    for i, (path, props) in enumerate(sorted(plots.items())):
        target = repo / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.suffix.lower() in IMAGE_EXT:
            # A distinct colour per file and revision, so the test can tell the images apart.
            buf = io.BytesIO()
            Image.new("RGB", (6, 4), (int(200 * scale) % 256, 10 * i, 90)).save(buf, format="PNG")
            target.write_bytes(buf.getvalue())
            written[path] = buf.getvalue()
        else:
            assert target.suffix == ".csv", f"{path}: only CSV data plots are written by this test"
            x, y = props.get("x", "step"), props.get("y", "value")
            rows = [{x: str(step), y: f"{scale * (i + 1) / (step + 1):.4f}"} for step in range(1, 6)]
            with target.open("w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=[x, y])
                w.writeheader()
                w.writerows(rows)
            written[path] = rows
    return written


class Page(HTMLParser):
    """Tags with their attributes, the text of each <script> and <style>, in document order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self.styles: list[str] = []
        self.paragraphs: list[str] = []
        self._open: tuple[str, dict[str, str | None]] | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag in ("script", "style", "p"):
            self._open, self._text = (tag, dict(attrs)), []

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._open is not None and tag == self._open[0]:
            text = "".join(self._text)
            if tag == "script":
                self.scripts.append((self._open[1], text))
            elif tag == "style":
                self.styles.append(text)
            else:
                self.paragraphs.append(text.strip())
            self._open = None


def parse(html: str) -> Page:
    page = Page()
    page.feed(html)
    page.close()
    return page


def assert_offline(html: str) -> Page:
    """The page fetches nothing remote (module docstring) and inlines vega, vega-lite, vega-embed."""
    page = parse(html)
    for tag, attrs in page.tags:
        for name, value in attrs.items():
            if name in FETCH_ATTRS and value is not None:
                for candidate in value.split(",") if name == "srcset" else [value]:
                    assert not REMOTE.match(candidate), f"<{tag} {name}={value!r}> loads a remote resource"
        if tag == "script":
            assert "src" not in attrs, f"<script src={attrs['src']!r}>: every script must be inline"
        if tag == "link":
            assert not REMOTE.match(attrs.get("href") or ""), f"<link href={attrs['href']!r}>"
        if tag == "meta" and (attrs.get("http-equiv") or "").lower() == "refresh":
            url = re.search(r"url\s*=\s*(\S+)", attrs.get("content") or "", re.IGNORECASE)
            assert url is None or not REMOTE.match(url.group(1)), f"meta refresh to {url.group(1)}"
    for _, text in page.scripts:
        hit = SCRIPT_IMPORT.search(text)
        assert hit is None, f"a script imports a remote module: {text[hit.start():hit.end() + 60]!r}"
    for text in page.styles:
        assert CSS_IMPORT.search(text) is None, f"a stylesheet loads a remote URL: {text!r}"

    # vega, vega-lite, vega-embed inline, in load order, before any plot calls vegaEmbed.
    vendored = {attrs.get("data-vendored", "").split("@")[0]: (i, attrs["data-vendored"], text)
                for i, (attrs, text) in enumerate(page.scripts) if attrs.get("data-vendored")}
    order = []
    for name in VENDORED:
        assert name in vendored, f"{name} is not inlined in the page (scripts: {sorted(vendored)})"
        i, label, text = vendored[name]
        assert len(text) > 20_000 and re.search(GLOBALS[name], text), f"{label}: not the {name} browser build"
        order.append(i)
    first_plot = min((i for i, (_, text) in enumerate(page.scripts) if "vegaEmbed('#" in text), default=None)
    assert order == sorted(order) and (first_plot is None or order[-1] < first_plot), "scripts out of order"
    wrapper = vendored.get("offline-wrapper")
    assert wrapper is not None and "editor: false" in wrapper[2], "the Vega Editor action is not turned off"
    return page


def specs(html: str) -> dict[str, dict]:
    """{div id: vega-lite spec} of every vega plot in a rendered page."""
    found = {div: json.loads(spec) for spec, div in SPEC.findall(html)}
    for div, spec in found.items():
        stack = [spec]
        while stack:  # no data the browser would have to fetch: vega loads every ``url`` it meets
            node = stack.pop()
            if isinstance(node, dict):
                assert "url" not in node, f"plot {div}: spec fetches {node['url']!r}"
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
    return found


def by_title(found: dict[str, dict]) -> dict[str, dict]:
    return {spec["title"]["text"]: spec for spec in found.values() if spec}


def image_sections(page: Page, out: Path) -> dict[str, list[tuple[str, bytes]]]:
    """{image plot path: [(revision, bytes of the file its <img> shows)]} from the rendered page.

    dvc-render writes ``<p>PATH</p>`` then, per revision, ``<p>REV</p><img src=...>``; the bytes come from
    the file the (relative) src names beside the page, so an image shows wherever the page is opened from.
    """
    sections: dict[str, list[tuple[str, bytes]]] = {}
    current: str | None = None
    last_text: str | None = None
    texts = iter(page.paragraphs)
    for tag, attrs in page.tags:
        if tag == "p":
            last_text = next(texts)
            if Path(last_text).suffix.lower() in IMAGE_EXT:
                current = last_text
                sections[current] = []
        elif tag == "img":
            src = attrs["src"] or ""
            assert current is not None and last_text is not None, f"<img src={src!r}> outside an image plot"
            assert not REMOTE.match(src) and not os.path.isabs(src), f"<img src={src!r}>: not a relative path"
            assert (out / src).is_file(), f"<img src={src!r}> names no file beside the page"
            sections[current].append((last_text, (out / src).read_bytes()))
    return sections


@pytest.fixture
def plots_repo(tmp_path: Path) -> tuple[Path, dict[str, dict]]:
    """A git+DVC repo with the repo's dvc.yaml, params.yaml, .dvc/config and HTML template."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    dvc(repo, "init", "-q")
    for name in ("dvc.yaml", "params.yaml", ".dvc/config"):
        shutil.copyfile(REPO / name, repo / name)
    template = template_path()
    (repo / template.relative_to(REPO)).parent.mkdir(parents=True)
    shutil.copyfile(template, repo / template.relative_to(REPO))
    plots = declared_plots()
    assert KNOWN <= set(plots), f"dvc.yaml lost declared plots: {sorted(KNOWN - set(plots))}"
    return repo, plots


# ------------------------------------------------------------------------------------------------- tests
def test_vendored_versions_are_the_ones_dvc_render_loads() -> None:
    """The inlined builds are the versions dvc-render's default page pulls from a CDN (its specs target them)."""
    from dvc_render.vega import VegaRenderer

    cdn = dict(re.findall(r"npm/(vega(?:-lite|-embed)?)@([\w.-]+)", VegaRenderer.SCRIPTS))
    assert set(cdn) == set(VENDORED), VegaRenderer.SCRIPTS
    page = parse(template_path().read_text(encoding="utf-8"))
    inlined = dict(attrs["data-vendored"].split("@") for attrs, _ in page.scripts
                   if "@" in (attrs.get("data-vendored") or ""))
    assert inlined == cdn, f"dvc-render now loads {cdn}; rebuild with vendor/vega/build_template.py"
    notice = (template_path().parent / "README.md").read_text()
    for name, version in inlined.items():
        assert f"{name}@{version}" in notice, f"vendor/vega/README.md does not record {name}@{version}"
        license_text = (template_path().parent / f"LICENSE.{name}").read_text()
        # BSD-3-Clause: the redistribution grant and its third (no-endorsement) clause.
        assert "Redistribution and use in source and binary forms" in license_text, name
        assert "Neither the name" in license_text, name


def test_plots_show_renders_every_declared_plot_offline(plots_repo: tuple[Path, dict[str, dict]],
                                                         tmp_path: Path) -> None:
    repo, plots = plots_repo
    written = write_plots(repo, plots, scale=1.0)
    out = tmp_path / "elsewhere" / "page"  # outside the repo: the page must not need the repo's files
    dvc(repo, "plots", "show", "--out", str(out))
    html = (out / "index.html").read_text(encoding="utf-8")
    page = assert_offline(html)

    charts = by_title(specs(html))
    data_plots = sorted(p for p in plots if Path(p).suffix.lower() in VEGA_EXT)
    assert sorted(charts) == data_plots
    for path in data_plots:  # each chart holds exactly the rows written, with the declared axes
        spec, x, y = charts[path], plots[path].get("x", "step"), plots[path].get("y", "value")
        got = [{x: v[x], y: v[y]} for v in spec["data"]["values"]]
        assert got == written[path], path
        assert {v["rev"] for v in spec["data"]["values"]} == {"workspace"}

    image_plots = sorted(p for p in plots if Path(p).suffix.lower() in IMAGE_EXT)
    shown = image_sections(page, out)
    assert sorted(shown) == image_plots
    for path in image_plots:
        assert shown[path] == [("workspace", written[path])], path


def test_plots_diff_renders_both_revisions_offline(plots_repo: tuple[Path, dict[str, dict]], tmp_path: Path) -> None:
    repo, plots = plots_repo
    old = write_plots(repo, plots, scale=1.0)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "plots at HEAD")
    new = write_plots(repo, plots, scale=2.0)
    out = tmp_path / "diff"
    dvc(repo, "plots", "diff", "HEAD", "--out", str(out))
    html = (out / "index.html").read_text(encoding="utf-8")
    page = assert_offline(html)

    charts = by_title(specs(html))
    data_plots = sorted(p for p in plots if Path(p).suffix.lower() in VEGA_EXT)
    assert sorted(charts) == data_plots
    for path in data_plots:
        x, y = plots[path].get("x", "step"), plots[path].get("y", "value")
        per_rev: dict[str, list[dict]] = {}
        for v in charts[path]["data"]["values"]:
            per_rev.setdefault(v["rev"], []).append({x: v[x], y: v[y]})
        assert per_rev == {"HEAD": old[path], "workspace": new[path]}, path

    image_plots = sorted(p for p in plots if Path(p).suffix.lower() in IMAGE_EXT)
    shown = image_sections(page, out)
    assert sorted(shown) == image_plots
    for path in image_plots:
        assert old[path] != new[path]
        assert sorted(shown[path]) == [("HEAD", old[path]), ("workspace", new[path])], path


def test_a_fresh_clone_draws_every_committed_revision_of_the_data_plots(
        plots_repo: tuple[Path, dict[str, dict]], tmp_path: Path) -> None:
    """With the repo's .gitignore the plot data (CSV) is in git and the images are not: a clone
    made without any DVC cache or remote draws both committed revisions of every data plot."""
    repo, plots = plots_repo
    shutil.copyfile(REPO / ".gitignore", repo / ".gitignore")
    data_plots = sorted(p for p in plots if Path(p).suffix.lower() in VEGA_EXT)
    old = write_plots(repo, plots, scale=1.0)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "plots, first revision")
    new = write_plots(repo, plots, scale=2.0)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "plots, second revision")
    tracked = git(repo, "ls-files", "plots").stdout.split()
    assert sorted(tracked) == data_plots  # the data in git, no image
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    out = tmp_path / "diff"
    dvc(clone, "plots", "diff", "HEAD~1", "--out", str(out), "--targets", *data_plots)  # images need a remote
    charts = by_title(specs((out / "index.html").read_text(encoding="utf-8")))
    for path in data_plots:
        x, y = plots[path].get("x", "step"), plots[path].get("y", "value")
        per_rev: dict[str, list[dict]] = {}
        for v in charts[path]["data"]["values"]:
            per_rev.setdefault(v["rev"], []).append({x: v[x], y: v[y]})
        assert per_rev == {"HEAD~1": old[path], "workspace": new[path]}, path


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "chromium-headless-shell", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.mark.skipif(chromium() is None, reason="no Chromium (Debian: apt-get install chromium-headless-shell)")
def test_vega_charts_draw_with_no_network(plots_repo: tuple[Path, dict[str, dict]], tmp_path: Path) -> None:
    """Headless Chromium with every host name unresolvable: each chart draws its marks, an empty plot says so."""
    repo, plots = plots_repo
    write_plots(repo, plots, scale=1.0)
    (repo / "plots" / "dev.csv").write_text("step,dev\n")  # as a run killed before its first dev evaluation
    out = tmp_path / "page"
    dvc(repo, "plots", "show", "--out", str(out))
    html = (out / "index.html").read_text(encoding="utf-8")
    divs = specs(html)
    empty = sorted(div for div, spec in divs.items() if not spec)
    assert empty == ["plots_dev_csv"]

    proc = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-extensions",
         f"--user-data-dir={tmp_path / 'chrome-profile'}", "--host-resolver-rules=MAP * ~NOTFOUND",
         "--virtual-time-budget=10000", "--dump-dom", (out / "index.html").as_uri()],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = re.sub(r"<script\b.*?</script>", "", proc.stdout, flags=re.DOTALL)  # the inlined code, not the page
    starts = {div: dom.find(f'id="{div}"') for div in divs}
    assert all(pos >= 0 for pos in starts.values()), starts
    bounds = sorted(starts.values()) + [len(dom)]
    for div, pos in starts.items():
        section = dom[pos:bounds[bounds.index(pos) + 1]]
        if div in empty:
            assert "no data points" in section and 'class="marks"' not in section, section[:500]
        else:  # vega-embed drew the chart: a canvas (its default renderer) with the marks
            assert re.search(r'<canvas[^>]*class="marks"', section), f"{div}: no chart drawn:\n{section[:500]}"
            assert "vega-embed" in section and "Open in Vega Editor" not in section
