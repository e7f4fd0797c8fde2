"""Rebuild ``template.html``: DVC's HTML plot template with vega, vega-lite and vega-embed inlined.

Usage (from the repository root; ``npm pack`` fetches the tarballs through npm's own client)::

    cd /tmp && npm pack vega@5.20.2 vega-lite@5.2.0 vega-embed@6.18.2
    python vendor/vega/build_template.py /tmp/vega-5.20.2.tgz /tmp/vega-lite-5.2.0.tgz /tmp/vega-embed-6.18.2.tgz

The versions are the ones dvc-render's ``VegaRenderer.SCRIPTS`` loads from a CDN, so the specs DVC writes
(vega-lite v5) render the same. The minified browser builds (each package.json's ``jsdelivr`` field, the file
the CDN serves for ``npm/<name>@<version>``) are read straight from the tarballs, their trailing
``sourceMappingURL`` comment dropped (the maps are not shipped), and written inside ``<script>`` elements of
the template. The package LICENSE files are copied beside it.

dvc-render fills a template by plain ``str.replace`` of ``{scripts}``, ``{plot_divs}`` and ``{refresh_tag}``;
the template leaves out ``{scripts}`` (which would bring back the CDN ``<script src=...>`` tags) and keeps the
other two. A script that contained ``</script`` or one of the placeholders would corrupt the page, so the
build refuses it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Load order matters: vega-lite's UMD build needs the global ``vega``, vega-embed needs both.
PACKAGES = ("vega", "vega-lite", "vega-embed")
PLACEHOLDERS = ("{scripts}", "{plot_divs}", "{refresh_tag}")
SOURCE_MAP = re.compile(r"\n?//# sourceMappingURL=\S+\s*$")

# Runs after vega-embed: DVC's plot divs call the global ``vegaEmbed('#id', spec)`` with no options.
# - the "Open in Vega Editor" action (it posts the spec to a web page) is turned off: the page stays local;
# - DVC writes ``spec = {}`` for a declared plot with no data points (file missing, or only a header, as
#   dev_sts.csv / dev_rsum.csv are for the method that does not write them): say so instead of a blank box.
WRAPPER = """\
(function () {
  "use strict";
  var embed = window.vegaEmbed;
  var offline = function (el, spec, opt) {
    if (spec && typeof spec === "object" && Object.keys(spec).length === 0) {
      var div = typeof el === "string" ? document.querySelector(el) : el;
      if (div) {
        var note = document.createElement("p");
        note.className = "dvc-no-data";
        note.textContent = div.id + ": no data points (the plot file is missing or empty)";
        div.appendChild(note);
      }
      return Promise.resolve(null);
    }
    var actions = {export: true, source: true, compiled: true, editor: false};
    return embed(el, spec, Object.assign({actions: actions}, opt || {}));
  };
  for (var key in embed) { offline[key] = embed[key]; }
  window.vegaEmbed = offline;
})();"""

PAGE = """\
<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    {refresh_tag}
    <title>DVC Plot</title>
    <!-- Offline template (vendor/vega/README.md): {versions} are inlined below, BSD-3-Clause,
         see vendor/vega/LICENSE.*; dvc-render's "scripts" placeholder (its CDN script tags) is left out on purpose. -->
{inline}
    <style>
        table {
            border-spacing: 15px;
        }
        .dvc-no-data {
            color: #666;
            font-style: italic;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def read_package(tgz: Path) -> tuple[str, str, str, str]:
    """(name, version, minified browser build, LICENSE text) of one ``npm pack`` tarball."""
    with tarfile.open(tgz, "r:gz") as tar:
        def member(name: str) -> str:
            try:
                fh = tar.extractfile(f"package/{name}")
            except KeyError:
                fh = None
            if fh is None:
                raise SystemExit(f"{tgz}: no package/{name} inside (not an npm pack tarball?)")
            return fh.read().decode("utf-8")

        meta = json.loads(member("package.json"))
        build = meta.get("jsdelivr") or meta.get("unpkg")
        if not build:
            raise SystemExit(f"{tgz}: package.json names no browser build (jsdelivr/unpkg field)")
        return meta["name"], meta["version"], member(build), member("LICENSE")


def check_script(name: str, js: str) -> None:
    if re.search(r"</script", js, re.IGNORECASE) or "<!--" in js:
        raise SystemExit(f"{name}: the build contains '</script' or '<!--' and cannot be inlined in <script>")
    for ph in PLACEHOLDERS:
        if ph in js:
            raise SystemExit(f"{name}: the build contains {ph}, which dvc-render would replace")


def build(tarballs: list[Path], out_dir: Path) -> Path:
    """Write template.html and LICENSE.<name> into ``out_dir``; return the template's path."""
    from mmcse.io import write_bytes  # atomic: a failed build leaves the old template in place

    found = {}
    for tgz in tarballs:
        name, version, js, license_text = read_package(tgz)
        found[name] = (version, js, license_text)
    missing = [p for p in PACKAGES if p not in found]
    if missing or len(found) != len(PACKAGES):
        raise SystemExit(f"need exactly the tarballs of {', '.join(PACKAGES)}; missing: {missing or 'none'}, "
                         f"got: {sorted(found)}")

    blocks = []
    for name in PACKAGES:
        version, js, license_text = found[name]
        js = SOURCE_MAP.sub("", js).rstrip() + "\n"
        check_script(f"{name}@{version}", js)
        blocks.append(f'    <script data-vendored="{name}@{version}">\n{js}    </script>')
        write_bytes(out_dir / f"LICENSE.{name}", license_text.encode("utf-8"))
        (out_dir / f"LICENSE.{name}").chmod(0o644)  # mkstemp made it owner-only
    check_script("wrapper", WRAPPER)
    if PAGE.count("{scripts}") or PAGE.count("{plot_divs}") != 1:
        raise SystemExit("PAGE must hold {plot_divs} once and no {scripts}")
    blocks.append(f'    <script data-vendored="offline-wrapper">\n{WRAPPER}\n    </script>')

    versions = ", ".join(f"{name}@{found[name][0]}" for name in PACKAGES)
    page = PAGE.replace("{versions}", versions).replace("{inline}", "\n".join(blocks))
    target = out_dir / "template.html"
    write_bytes(target, page.encode("utf-8"))
    target.chmod(0o644)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tarballs", nargs=3, type=Path, help="the npm pack tarballs of vega, vega-lite, vega-embed")
    parser.add_argument("--out-dir", type=Path, default=HERE)
    args = parser.parse_args(argv)
    target = build(args.tarballs, args.out_dir)
    print(f"{target}: {target.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
