"""The documentation builds without warnings, and every Python example in it runs.

Each page of ``docs/`` and the README is one script: its ```python blocks, in order,
concatenated and run in a fresh interpreter (so ``if __name__ == "__main__":`` and the
spawn start method behave as they do for a user's script). A failure names the page,
the block and its line.

Three markers, each an HTML comment on the line before a fence (invisible on the page):

    <!-- doc: no-run -->   the next ```python block is only compiled, not run. Keep rare.
    <!-- doc: output -->   the next fenced block must equal what the previous ```python
                           block printed (trailing spaces ignored).
    <!-- doc: needs M -->  the next ```python block uses the optional library M (a module
                           name): run where M is installed, only compiled where it is not.
                           Later blocks must not depend on it.

Python blocks must start at the left margin: an indented one (in a list or an admonition)
would be rendered but not run, so it is refused. Shell blocks are not run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]
PYTHON = ("python", "py")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>[^`]*?)\s*$")
_MARKER = re.compile(r"^<!--\s*doc:\s*(?P<name>[\w-]+)(?:\s+(?P<argument>[\w.]+))?\s*-->$")
_BLOCK_START = "\x1edoc-block "  # printed before each block to split the script's output


@dataclass(frozen=True)
class Block:
    page: Path
    lang: str
    line: int  # of the first code line, 1-based
    code: str
    marker: str | None  # "no-run", "output", "needs" or None
    needs: str | None = None  # the module a "needs" block uses

    @property
    def runs(self) -> bool:
        """A Python block the page's script runs (else it is only compiled)."""
        if self.lang not in PYTHON or self.marker == "no-run":
            return False
        return self.needs is None or importlib.util.find_spec(self.needs) is not None

    @property
    def where(self) -> str:
        return f"{_name(self.page)}:{self.line}"


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def blocks_of(page: Path) -> list[Block]:
    """Fenced blocks of a Markdown page with the marker before each, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence, lang = opening["fence"], (opening["info"].split() or [""])[0].lower()
        previous = next((line.strip() for line in reversed(lines[:index]) if line.strip()), "")
        marker = _MARKER.match(previous)
        if marker is None and previous.startswith("<!--"):
            raise AssertionError(
                f"{_name(page)}:{index + 1}: {previous} is no doc marker (it would be ignored); "
                "write <!-- doc: no-run -->, <!-- doc: output --> or <!-- doc: needs MODULE -->"
            )
        end = index + 1
        while end < len(lines) and not re.fullmatch(rf"\s*{re.escape(fence[0])}{{{len(fence)},}}\s*", lines[end]):
            end += 1
        if lang in PYTHON and opening["indent"]:
            raise AssertionError(
                f"{_name(page)}:{index + 1}: an indented python block is rendered but never run; "
                "move it to the left margin"
            )
        code = "\n".join(lines[index + 1 : end]) + "\n"
        found.append(
            Block(page, lang, index + 2, code, marker["name"] if marker else None, marker["argument"] if marker else None)
        )
        index = end + 1
    unknown = {block.marker for block in found} - {None, "no-run", "output", "needs"}
    assert not unknown, f"{_name(page)}: unknown doc markers {sorted(unknown)}"
    for block in found:
        assert (block.needs is not None) == (block.marker == "needs"), (
            f"{block.where}: write <!-- doc: needs MODULE --> (and no argument to the other markers)"
        )
    return found


def _pages_with_python() -> list[Path]:
    return [page for page in PAGES if page.exists() and any(b.lang in PYTHON for b in blocks_of(page))]


def _split_output(stdout: str, count: int) -> list[str]:
    """The output of each block, from the marker lines printed before each."""
    parts = stdout.split(_BLOCK_START)[1:]
    outputs = [part.split("\n", 1)[1] if "\n" in part else "" for part in parts]
    return outputs + [""] * (count - len(outputs))


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


@pytest.mark.parametrize("page", _pages_with_python(), ids=_name)
def test_examples_run(page, tmp_path):
    blocks = blocks_of(page)
    runnable = [b for b in blocks if b.runs]
    for block in blocks:
        if block.lang in PYTHON and not block.runs:
            compile(block.code, block.where, "exec")  # not run, but at least valid Python

    script = tmp_path / f"{page.stem}_examples.py"
    starts: list[int] = []  # first script line of each runnable block
    text = ""
    for number, block in enumerate(runnable):
        # Guarded so that a spawned child, which re-imports this script, prints nothing.
        text += f'if __name__ == "__main__": print({_BLOCK_START + str(number)!r}, flush=True)\n'
        starts.append(text.count("\n") + 1)
        text += block.code
    script.write_text(text, encoding="utf-8")

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        result = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100
        )
    except subprocess.TimeoutExpired as timeout:
        out = timeout.stdout.decode() if isinstance(timeout.stdout, bytes) else timeout.stdout or ""
        reached = out.count(_BLOCK_START) - 1
        block = runnable[max(reached, 0)]
        pytest.fail(f"{block.where}: the example did not finish within {timeout.timeout} s")

    if result.returncode != 0:
        # The outermost frame of the script in the last traceback is the top-level statement
        # that failed; deeper frames may lie in functions that earlier blocks defined.
        last = result.stderr.rsplit("Traceback (most recent call last)", 1)[-1]
        frame = re.search(rf'File "{re.escape(str(script))}", line (\d+)', last)
        line = int(frame.group(1)) if frame else 0
        failing = max((i for i, start in enumerate(starts) if start <= line), default=None)
        where = runnable[failing].where if failing is not None else f"{_name(page)} (no line found)"
        pytest.fail(f"{where}: the example failed\n{result.stderr[-3000:]}")

    outputs = _split_output(result.stdout, len(runnable))
    last_python: Block | None = None
    for block in blocks:
        if block.lang in PYTHON:
            last_python = block
        elif block.marker == "output":
            assert last_python is not None and last_python in runnable, f"{block.where}: output of no runnable block"
            # The site wraps ```text blocks where they are shown (docs/css/extra.css).
            assert block.lang == "text", f"{block.where}: write output as a ```text block, so the site wraps it"
            printed = outputs[runnable.index(last_python)]
            assert _normalise(printed) == _normalise(block.code), (
                f"{block.where}: the page shows output that {last_python.where} does not print; "
                f"it prints:\n{printed}"
            )


def test_every_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))

    def pages(entries: list) -> set[str]:
        found: set[str] = set()
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            found |= pages(value) if isinstance(value, list) else {value}
        return found

    on_disk = {str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md")}
    assert on_disk - pages(config["nav"]) == set(), "pages missing from the nav of mkdocs.yml"


def test_docs_build_without_warnings(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=100,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert (tmp_path / "site" / "index.html").exists()


def test_the_marker_parser(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n<!-- doc: no-run -->\n\n```python\nx = 1\n```\n\n"
        "````markdown\n```python\nnot a block\n```\n````\n\n<!-- doc: output -->\n```text\n1\n```\n",
        encoding="utf-8",
    )
    blocks = [(b.lang, b.line, b.marker, b.code) for b in blocks_of(page)]
    assert blocks == [
        ("python", 6, "no-run", "x = 1\n"),
        ("markdown", 10, None, "```python\nnot a block\n```\n"),
        ("text", 17, "output", "1\n"),
    ]
    page.write_text("- item\n\n    ```python\n    x = 1\n    ```\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="indented python block"):
        blocks_of(page)
    page.write_text("<!-- output -->\n```text\n1\n```\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="no doc marker"):
        blocks_of(page)


def test_a_block_that_needs_a_library_runs_only_where_it_is_installed(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- doc: needs json -->\n```python\nimport json\n```\n\n"
        "<!-- doc: needs no_such_module_here -->\n```python\nimport no_such_module_here\n```\n",
        encoding="utf-8",
    )
    installed, absent = blocks_of(page)
    assert (installed.marker, installed.needs, installed.runs) == ("needs", "json", True)
    assert (absent.needs, absent.runs) == ("no_such_module_here", False)
    for wrong in ("<!-- doc: needs -->", "<!-- doc: no-run json -->"):
        page.write_text(f"{wrong}\n```python\nx = 1\n```\n", encoding="utf-8")
        with pytest.raises(AssertionError, match="needs MODULE"):
            blocks_of(page)


def test_readme_gives_two_commands_and_ci_runs_the_second():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Try it", 1)[1].split("\n## ", 1)[0]
    commands = [b.code.strip() for b in blocks_of(ROOT / "README.md") if b.lang == "bash" and b.code.strip() in section]
    assert len(commands) == 2 and all("\n" not in command for command in commands)
    demo, tests = commands
    assert demo.startswith("python3 -m venv .venv && ") and demo.endswith("&& python -m mprs_plus demo")
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert tests in ci_lines, ".ci/run must run the README's test command as written"


def test_readme_lists_every_argument_of_the_service_as_the_signature_has_it():
    import inspect

    from mprs_plus import MultiProcessingReadingService

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    paragraph = readme.split("The arguments are torchdata's:", 1)[1].split("\n\n", 1)[0]
    positional_text, keyword_text = paragraph.split("keyword-only:", 1)
    named = re.compile(r"`([a-z_]+)`")  # argument names only: `in_order`, not `.batch(n)` or links
    parameters = list(inspect.signature(MultiProcessingReadingService).parameters.values())
    positional = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keyword_only = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert named.findall(positional_text) == positional, "the README's torchdata arguments differ from the signature"
    assert named.findall(keyword_text) == keyword_only, "the README's keyword-only arguments differ from the signature"


@pytest.mark.parametrize(
    "num_workers, prefetch, bound",
    [(2, 10, 1088), (4, 10, 960), (8, 10, 896), (10, 10, 832), (32, 10, 832), (2, 0, 192), (16, 0, 192)],
)
def test_the_small_items_bound_of_the_troubleshooting_page_is_the_services(num_workers, prefetch, bound):
    from mprs_plus.options import Options

    # The page's figures, each computed here from the options the service sizes its channels with.
    page = " ".join((DOCS / "troubleshooting.md").read_text(encoding="utf-8").split())
    assert "`(B + 2) × 64` small items" in page and "`B = 10 + ceil(10 / num_workers)`" in page
    assert f"{bound:,}" in page
    options = Options(num_workers=num_workers, worker_prefetch_cnt=prefetch, main_prefetch_cnt=prefetch)
    assert (options.items_in_flight_per_worker + 2) * 64 == bound


def test_the_readme_says_where_the_banner_comes_from_and_its_setting_silences_just_it():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = next(line for line in readme.splitlines() if "modules are deprecated" in line)
    assert "torchdata" in line
    setting = re.search(r"`PYTHONWARNINGS=([^`]+)`", line).group(1)
    code = "import warnings, torchdata.datapipes, torchdata.dataloader2; warnings.warn('the program warns')"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}
    shown = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "modules are deprecated" in shown.stderr  # torchdata prints it...
    quiet = subprocess.run(
        [sys.executable, "-c", code], env={**env, "PYTHONWARNINGS": setting}, capture_output=True, text=True, timeout=60
    )
    assert "modules are deprecated" not in quiet.stderr, quiet.stderr  # ...and the README's setting silences it
    assert "the program warns" in quiet.stderr  # and nothing else
