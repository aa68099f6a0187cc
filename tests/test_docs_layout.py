"""Every page of the built docs fits the window, at a desk and on a phone.

The site is built once, then one headless Chromium (tests/browser.py) opens every page at
1280 and at 390 CSS pixels and checks what a reader would see:

- the page is no wider than the window: nothing pushes it sideways (a wide table scrolls
  inside its own box instead);
- example output (```text blocks) is wrapped, never cut or scrolled (a diagram,
  ```{.text .diagram}, keeps its lines and may scroll inside its box);
- a picture is shown at no less than half its drawn width at 1280 px, so its labels stay
  readable (a chart drawn twice the column's width for sharp screens is fine).

Skipped where no Chromium is installed (.ci/run installs it). With
MPRS_PLUS_DOCS_SCREENSHOTS=DIR, a full-page screenshot of every page at both widths is
written there too, to look at; that takes minutes, so run it with ``--timeout 600``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from browser import Browser, find_chromium

ROOT = Path(__file__).resolve().parent.parent
WIDTHS = (1280, 390)

# What the reader would see, measured in the page: elements that stick out of the window
# (the outermost of each), output blocks that scroll, pictures shrunk below half their size.
_MEASURE = """
(() => {
  const width = document.documentElement.clientWidth;
  const name = (el) => {
    const text = (el.textContent || "").trim().replace(/\\s+/g, " ").slice(0, 70);
    return `<${el.tagName.toLowerCase()} class="${el.className}"> "${text}"`;
  };
  // Inside a box that scrolls (or clips) sideways, an element may be wider than the window.
  const boxed = (el) => {
    for (let up = el.parentElement; up && up !== document.body; up = up.parentElement) {
      if (getComputedStyle(up).overflowX !== "visible") return true;
    }
    return false;
  };
  const outside = [];
  for (const el of document.querySelectorAll("body *")) {
    const box = el.getBoundingClientRect();
    if (box.width > 0 && (box.right > width + 1 || box.left < -1) && !outside.some((o) => o.contains(el)) && !boxed(el)) {
      outside.push(el);
    }
  }
  const scrolled = [...document.querySelectorAll(".language-text:not(.diagram) pre")]
    .filter((pre) => pre.scrollWidth > pre.clientWidth + 1);
  const shrunk = [...document.querySelectorAll("[role=main] img")]
    .filter((img) => img.naturalWidth > 0 && img.getBoundingClientRect().width < img.naturalWidth / 2)
    .map((img) => `${img.getAttribute("src")}: drawn ${img.naturalWidth} px wide, shown at ${Math.round(img.getBoundingClientRect().width)}`);
  return {
    page_width: document.documentElement.scrollWidth,
    width,
    outside: outside.map(name),
    scrolled: scrolled.map(name),
    shrunk,
  };
})()
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=100,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return out


def _pages(site: Path) -> list[Path]:
    skip = {"search", "assets", "css", "js", "img", "webfonts"}
    return sorted(page for page in site.rglob("index.html") if not skip & set(page.relative_to(site).parts))


def _name(site: Path, page: Path) -> str:
    folder = page.parent.relative_to(site).as_posix()
    return "index" if folder == "." else folder.replace("/", "_")


def test_every_page_fits_the_window_at_a_desk_and_on_a_phone(site, tmp_path):
    program = find_chromium()
    if program is None:
        pytest.skip("needs Chromium (Debian's package 'chromium'); .ci/run installs it")
    shots = os.environ.get("MPRS_PLUS_DOCS_SCREENSHOTS")
    pages = _pages(site)
    assert len(pages) > 10, f"the site has only {len(pages)} pages"
    problems: list[str] = []
    with Browser(program, tmp_path / "profile") as browser:
        for width in WIDTHS:
            for page in pages:
                browser.open(page.as_uri(), width)
                seen = browser.evaluate(_MEASURE)
                name = _name(site, page)
                where = f"{name} at {width} px"
                if seen["page_width"] > seen["width"]:
                    problems.append(f"{where}: the page is {seen['page_width']} px wide; sticking out: {seen['outside']}")
                if seen["scrolled"]:
                    problems.append(f"{where}: output that scrolls instead of wrapping: {seen['scrolled']}")
                if width >= 1280 and seen["shrunk"]:
                    problems.append(f"{where}: pictures too small to read: {seen['shrunk']}")
                if shots:
                    Path(shots).mkdir(parents=True, exist_ok=True)
                    browser.screenshot(Path(shots) / f"{name}-{width}.png")
    assert not problems, "\n".join(problems)
