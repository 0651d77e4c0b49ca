"""The docs site (`make docs`, `docs/`): it builds without a single warning, and reads right in a real browser.

The site is served on loopback and opened in headless Chromium (`CHROMIUM`, by default Debian's
`chromium`, which `make test` installs where it can: as root or with sudo that asks no password), the
way a reader sees it: the landing page links to every notebook's page; the header bar opens each of the
guide pages (cluster, testing, changes) with its title and no link to a missing page or anchor; each
notebook page shows its title, its "What you should see" box (the notebook's cell tagged `what-you-should-see`), its code
cells and no Python traceback, and in a 1280-pixel window no code block scrolls sideways; a screenshot
of each page is kept in `test-artifacts/docs/screenshots/`. Without Chromium the browser tests are
skipped, with the reason in pytest's summary (the build tests still run), unless `CI=true`: there they
fail. A small fixture site checks that notebook Markdown renders (notes, tables, images,
highlighted code, `remove-cell`/`remove-input` tags), and a broken one that a bad cross-reference, an
unknown code language, a notebook that is not JSON or a notebook page without its "What you should see"
file fails the build.

A second build, from a stand-in `make run` folder (`DOCS_RUNS`), checks that each page then shows that
run's outputs (a plot), its run time and date, and a working download of the notebook, executing nothing,
and that a notebook changed since its run falls back to the box. The guide pages' tables (which technique
when, the learning path, troubleshooting) are checked against the code that makes them.

`DOCS_EXECUTE=1 make docs` also runs the `docs_executed` test here on the executed site: every notebook
page shows a plot, says it comes from the smoke run, and has no output that needs a script from a CDN.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import nbformat
import pytest
from browser import CHROMIUM_FLAGS, chromium_or_skip
from notebook_runs import ARTIFACTS, NOTEBOOKS, ROOT

DOCS = ROOT / "docs"
SCREENSHOTS = ARTIFACTS / "docs" / "screenshots"
NOTEBOOK_FILES = sorted(NOTEBOOKS.glob("*.ipynb"))
# The guide pages the header bar links to, besides the tutorials and the reference.
GUIDE_PAGES = ["techniques", "cluster", "gpu", "troubleshooting", "testing", "changes"]
# As `make docs` builds: warnings are errors, all of them reported, from a fresh environment.
SPHINX = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html"]


def sphinx_build(src: Path, out: Path, conf_dir: Path = DOCS, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SPHINX, "-c", str(conf_dir), str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DOCS_EXECUTE": "0", **env},  # the committed notebooks, not executed
    )


def notebook_title(path: Path) -> str:
    first = nbformat.read(path, as_version=4).cells[0].source.splitlines()[0]
    return first.removeprefix("# ").replace("`", "")


def page_title(name: str) -> str:
    """The title of docs/`name`.md, as its first line gives it."""
    return (DOCS / f"{name}.md").read_text().splitlines()[0].removeprefix("# ").replace("`", "")


def missing_link_targets(site: Path, base_url: str, hrefs: list[str]) -> list[str]:
    """The links among `hrefs` (absolute, as the browser resolves them) into the site served at `base_url`
    whose page or anchor does not exist in `site`."""
    missing = []
    for href in hrefs:
        if not href.startswith(base_url + "/"):
            continue  # another site, `mailto:`, ...
        path, _, anchor = href.removeprefix(base_url + "/").partition("#")
        target = site / path.partition("?")[0]
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file():
            missing.append(href)
        elif anchor and not re.search(rf'id="{re.escape(anchor)}"', target.read_text()):
            missing.append(href)
    return missing


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serve(site: Path) -> Iterator[str]:
    """Serve `site` on a free loopback port for the duration of the block; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `make docs` builds it in a checkout with no `make run` yet (notebooks not executed), or
    the one in `DOCS_SITE`."""
    if os.environ.get("DOCS_SITE"):
        return Path(os.environ["DOCS_SITE"])
    out = ARTIFACTS / "docs" / "html"
    shutil.rmtree(out, ignore_errors=True)
    proc = sphinx_build(DOCS, out, DOCS_RUNS=str(tmp_path_factory.mktemp("no-runs")))
    assert proc.returncode == 0, f"the docs build warned or failed:\n{proc.stderr[-6000:]}"
    return out


def _png(width: int = 320, height: int = 200) -> str:
    """A small plot as a notebook's image/png output (base64)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(width / 100, height / 100), dpi=100)
    plt.plot([3, 2, 1])
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


RUN_SECONDS = 61.5  # the runs the run_site's pages are rendered from


@pytest.fixture(scope="module")
def run_site(tmp_path_factory) -> Iterator[tuple[Path, str]]:
    """The site as `make docs` builds it after a `make run`: from a run folder with each notebook as
    papermill leaves it (a stand-in output per code cell, a plot where the notebook plots), except
    llama_lora, whose run copy has code that differs from the committed notebook's."""
    runs = tmp_path_factory.mktemp("runs")
    folder = runs / "20990101-000000"
    folder.mkdir()
    (folder / "environment.json").write_text('{"python": "3.11.7", "cores": 2, "versions": "torch 0.0"}')
    png = _png()
    for path in NOTEBOOK_FILES:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran in the smoke run\n")]
            if "plt.show()" in cell.source:
                cell.outputs.append(nbformat.v4.new_output("display_data", data={"image/png": png}))
        if path.stem == "llama_lora":
            nb.cells[-1].source += "\n# edited after the run"
        nb.metadata["papermill"] = {
            "end_time": "2099-01-01T00:01:01",
            "duration": RUN_SECONDS,
            "exception": None,
        }
        nbformat.write(nb, folder / path.name)
    # Only the notebook pages (docs/conf.py, the notebooks, the label their facts link to): the guide pages
    # and the reference are the default site's.
    src = tmp_path_factory.mktemp("src")
    (src / "notebooks").symlink_to(NOTEBOOKS)
    pages = "\n".join(f"notebooks/{p.stem}" for p in NOTEBOOK_FILES)
    (src / "index.md").write_text(
        f"# Notebooks\n\n(run-the-notebooks)=\n## Run\n\n```{{toctree}}\n{pages}\n```\n"
    )
    out = ARTIFACTS / "docs" / "html-after-run"
    shutil.rmtree(out, ignore_errors=True)
    proc = sphinx_build(src, out, DOCS_RUNS=str(runs))
    assert proc.returncode == 0, f"the docs build warned or failed:\n{proc.stderr[-6000:]}"
    with serve(out) as url:
        yield out, url


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium with a fresh profile; every request that leaves loopback is blocked and recorded."""
    from playwright.sync_api import sync_playwright

    chromium = chromium_or_skip()
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),  # --user-data-dir
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 900},
        )
        context.external_requests = []

        def keep_local(route):
            if route.request.url.startswith("http://127.0.0.1:"):
                route.continue_()
            else:  # e.g. an image the original tutorial links from GitHub: the test machine is offline
                context.external_requests.append(route.request.url)
                route.abort()

        context.route("**/*", keep_local)
        yield context
        context.close()


@contextlib.contextmanager
def open_page(browser, url: str, viewport: dict[str, int] | None = None):
    """A page at `url` (in a window of `viewport`'s size if given), failing the test on any JavaScript error."""
    page = browser.new_page()
    if viewport:
        page.set_viewport_size(viewport)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url, wait_until="load")
    yield page
    page.close()
    assert not errors, f"JavaScript errors on {url}: {errors}"


@pytest.fixture(scope="module")
def base_url(site) -> Iterator[str]:
    with serve(site) as url:
        yield url


def test_every_notebook_has_a_page_and_the_reference_is_there(site):
    for path in NOTEBOOK_FILES:
        assert (site / "notebooks" / f"{path.stem}.html").is_file(), path.stem
    api = (site / "api.html").read_text()
    for module in (
        "harness.cluster",
        "basics.validate",
        "harness.fixtures",
        "harness.observe",
        "helpers.notebook",
    ):
        assert f'id="module-{module}"' in api, module
    assert "harness.cluster.start_ray" in api  # a function documented from its docstring
    assert "harness.observe.watch" in api


def test_landing_page_links_to_every_notebook_page(browser, base_url):
    with open_page(browser, f"{base_url}/index.html") as page:
        assert page.locator("h1").first.inner_text().startswith("Distributed LLM fine-tuning on Ray")
        # links in the page's own text, not the navigation bars
        hrefs = page.locator("article a.reference").evaluate_all("links => links.map(a => a.href)")
        text = page.locator("article").inner_text()
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "index.png"), full_page=True)
    linked = {h.split("#")[0] for h in hrefs}
    for path in NOTEBOOK_FILES:
        assert f"{base_url}/notebooks/{path.stem}.html" in linked, f"no link to {path.stem}"
    for name in ["api", *GUIDE_PAGES]:
        assert f"{base_url}/{name}.html" in linked, f"no link to {name}"
    assert "papermill" in text and "SMOKE_TEST" in text  # how to run, at both scales


@pytest.mark.parametrize("name", GUIDE_PAGES)
def test_header_bar_opens_guide_page(browser, site, base_url, name):
    """The page is one click away in the header bar, renders with its title, and its links all land."""
    title = page_title(name)
    with open_page(browser, f"{base_url}/index.html") as page:
        link = page.locator(f".navbar-header-items__center a.nav-link[href='{name}.html']")
        assert link.is_visible(), f"no link to {name}.html in the header bar (or only behind a menu)"
        link.click()
        page.wait_for_url(f"{base_url}/{name}.html")
        h1 = page.locator("article h1").first
        assert h1.is_visible() and h1.inner_text() == title
        assert title in page.title()
        assert len(page.locator("article").inner_text()) > 2000  # the page's content, not an empty shell
        hrefs = page.locator("article a[href]").evaluate_all("links => links.map(a => a.href)")
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
    assert any(h.startswith(base_url + "/") for h in hrefs), "no link into the site"
    missing = missing_link_targets(site, base_url, hrefs)
    assert not missing, f"links on {name}.html to a page or anchor that does not exist: {missing}"


@pytest.mark.parametrize("path", NOTEBOOK_FILES, ids=lambda p: p.stem)
def test_notebook_page_shows_title_code_and_no_traceback(browser, base_url, path):
    nb = nbformat.read(path, as_version=4)
    # every code cell but the results cell (tagged remove-cell: plumbing for batch jobs and the tests)
    code_cells = [
        c for c in nb.cells if c.cell_type == "code" and "remove-cell" not in c.metadata.get("tags", [])
    ]
    with open_page(browser, f"{base_url}/notebooks/{path.stem}.html") as page:
        h1 = page.locator("article h1").first
        assert h1.is_visible()
        assert h1.inner_text().startswith(notebook_title(path))
        assert notebook_title(path) in page.title()
        inputs = page.locator("article div.cell_input")
        assert inputs.count() == len(code_cells)  # every code cell, none dropped
        assert inputs.first.is_visible() and inputs.last.is_visible()
        # the parameters cells (the lesson's knobs, the run settings), highlighted as Python
        first = inputs.first.text_content() + inputs.nth(1).text_content()
        assert "SMOKE_TEST =" in first and "NUM_WORKERS =" in first
        assert inputs.first.locator("span.n").count() > 0
        # the notebook's GitHub-style `> [!NOTE]` alerts, each an admonition
        alerts = sum(c.source.count("> [!NOTE]") for c in nb.cells if c.cell_type == "markdown")
        assert page.locator("article div.admonition.note").count() == alerts
        text = page.locator("article").inner_text()
        if path.stem != "operating_a_run":  # the one notebook made from no tutorial
            assert "What changed" in text  # from the original tutorial: a note or a section
        assert "Traceback (most recent call last)" not in text
        assert page.locator("article .output.traceback, article .output.error").count() == 0
        # the notebook's diagram: a local SVG the site copied, drawn (an image that failed to load has no size)
        diagram = page.locator("article img[src$='.svg']")
        assert diagram.count() == 1 and diagram.evaluate("img => img.complete && img.naturalWidth > 300")
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{path.stem}.png"), full_page=True)
    assert (SCREENSHOTS / f"{path.stem}.png").stat().st_size > 10_000


@pytest.mark.parametrize("path", NOTEBOOK_FILES, ids=lambda p: p.stem)
def test_notebook_page_says_what_you_should_see(browser, base_url, path):
    """On a site built before any `make run`, a box under the title says what a smoke run shows.

    Its points are those of the notebook's own cell tagged `what-you-should-see` (right after its training
    cell), each led by a bold phrase, and the full-scale result.
    """
    tagged = _what_you_should_see_cells(path)
    leads = [lead.replace("`", "") for lead in re.findall(r"\*\*(.+?)\*\*", tagged[0].source)][1:]
    assert len(leads) >= 3 and "At full scale" in leads
    with open_page(browser, f"{base_url}/notebooks/{path.stem}.html") as page:
        box = page.locator("article div.admonition.what-you-should-see")
        assert box.count() == 1 and box.is_visible()
        assert box.locator(".admonition-title").inner_text() == "What you should see"
        text = box.inner_text()
        assert "SMOKE_TEST=1" in text  # how to get there
        missing = [lead for lead in leads if lead not in text]
        assert not missing, f"not in the box: {missing}"
        # under the title and the page's facts (run time, reading time, download), before the notebook's text
        title_bottom = page.locator("article h1").first.bounding_box()
        title_bottom = title_bottom["y"] + title_bottom["height"]
        facts = page.locator("article div.page-facts").bounding_box()
        assert title_bottom <= facts["y"] < title_bottom + 100
        facts_bottom = facts["y"] + facts["height"]
        assert facts_bottom <= box.bounding_box()["y"] < facts_bottom + 100
        assert box.bounding_box()["y"] < page.locator("article div.cell_input").first.bounding_box()["y"]
        assert "Outputs from a CPU smoke run" not in page.locator("article").inner_text()


def _what_you_should_see_cells(path) -> list:
    nb = nbformat.read(path, as_version=4)
    return [c for c in nb.cells if "what-you-should-see" in c.metadata.get("tags", [])]


@pytest.mark.parametrize("path", NOTEBOOK_FILES, ids=lambda p: p.stem)
def test_every_notebook_says_what_you_should_see_right_after_training(path):
    nb = nbformat.read(path, as_version=4)
    tagged = _what_you_should_see_cells(path)
    assert len(tagged) == 1 and tagged[0].cell_type == "markdown"
    before = nb.cells[nb.cells.index(tagged[0]) - 1]
    # the training cell (operating_a_run hands its fits to the drill runner: `.fit,`)
    assert before.cell_type == "code" and (".fit()" in before.source or ".fit," in before.source)


# Every code block in a page's text (cell inputs and Markdown code), not the cells' outputs, whose log lines
# may be long and scroll: its width as shown and as its longest line needs.
CODE_BLOCK_WIDTHS = """article => [...article.querySelectorAll('pre, div.highlight')]
    .filter(el => !el.closest('.cell_output'))
    .map(el => ({
        first: el.innerText.split('\\n')[0],
        chars: Math.max(...el.innerText.split('\\n').map(line => line.length)),
        scroll: el.scrollWidth,
        client: el.clientWidth,
        font: parseFloat(getComputedStyle(el).fontSize),
    }))"""
# Scroll the page's longest code line to the middle of the window.
SHOW_LONGEST_CODE_LINE = """() => {
    let block = null, line = 0, chars = -1;
    for (const el of document.querySelectorAll('article.bd-article pre')) {
        if (el.closest('.cell_output')) continue;
        el.innerText.split('\\n').forEach((text, i) => {
            if (text.length > chars) [block, line, chars] = [el, i, text.length];
        });
    }
    const top = block.getBoundingClientRect().top + window.scrollY;
    window.scrollTo(0, top + line * parseFloat(getComputedStyle(block).lineHeight) - window.innerHeight / 2);
}"""


@pytest.mark.parametrize("path", NOTEBOOK_FILES, ids=lambda p: p.stem)
def test_notebook_page_code_reads_without_horizontal_scrolling(browser, base_url, path):
    """In a 1280x800 window (a laptop's) every code line is seen whole: no block scrolls sideways.

    The notebooks' lines run to about 120 characters (ruff's line length is 110, longer f-strings are
    left as they are); the theme's usual content column holds about 75 at its code font size.
    """
    url = f"{base_url}/notebooks/{path.stem}.html"
    with open_page(browser, url, viewport={"width": 1280, "height": 800}) as page:
        blocks = page.locator("article.bd-article").evaluate(CODE_BLOCK_WIDTHS)
        page_width = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
        page.evaluate(SHOW_LONGEST_CODE_LINE)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        # the window as a reader sees it, at the longest line
        page.screenshot(path=str(SCREENSHOTS / f"{path.stem}-code-1280.png"))
    assert len(blocks) >= len([c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"])
    cut = [b for b in blocks if b["scroll"] > b["client"] + 1]  # 1 px: sub-pixel rounding
    if cut:
        pytest.fail(
            f"{len(cut)} of {len(blocks)} code blocks scroll sideways at 1280 px (their text's width in the "
            "width shown):\n"
            + "\n".join(
                f"  {b['scroll']} px in {b['client']} px ({b['chars']} characters at {b['font']:g} px), "
                f"first line {b['first'][:70]!r}"
                for b in cut
            ),
            pytrace=False,
        )
    assert min(b["font"] for b in blocks) >= 12, "code shrunk below 12 px to fit"
    assert page_width[0] <= page_width[1], f"the page itself scrolls sideways: {page_width}"


@pytest.mark.parametrize("path", NOTEBOOK_FILES, ids=lambda p: p.stem)
def test_after_make_run_each_page_shows_that_runs_outputs_without_executing(browser, run_site, path):
    """`make docs` after `make run`: the run's outputs, its date and time, and the download, executing
    nothing; a notebook changed since its run is shown without outputs, as before any run."""
    site, url = run_site
    with open_page(browser, f"{url}/notebooks/{path.stem}.html") as page:
        facts = page.locator("article div.page-facts").inner_text()
        assert "Reading time: about" in facts and "Last verified:" in facts
        download = page.locator("article div.page-facts a.download")
        assert download.get_attribute("href").endswith(f"{path.stem}.ipynb")
        with page.expect_download() as got:
            download.click()
        assert nbformat.reads(Path(got.value.path()).read_text(), as_version=4).cells
        images = page.locator("article div.cell_output img")
        if path.stem == "llama_lora":  # its code changed since the run: no outputs, the box instead
            assert images.count() == 0 and page.locator("article div.what-you-should-see").count() == 1
            assert "not run in this checkout yet" in facts
            return
        assert f"Laptop run: {RUN_SECONDS:.0f} s on the last make run in this checkout (2099-01-01)" in facts
        assert images.count() >= 1, "no plot on the page"
        assert images.first.evaluate("img => img.complete && img.naturalWidth > 100")
        note = page.locator("article div.admonition.note").first.inner_text()
        assert "Outputs from a CPU smoke run" in note and "2099-01-01" in note and "torch 0.0" in note
        assert page.locator("article div.what-you-should-see").count() == 0


def test_the_guide_pages_tables_come_from_code(site):
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_tables", DOCS / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)

    techniques = (site / "techniques.html").read_text()
    for cell in re.findall(r"\d[\d,]* GB \(\d+%\): [a-z ,*]+", tables.techniques()):
        assert cell.split(":")[0] in techniques
    assert "too big" in techniques and "fits" in techniques
    path = (site / "tutorials.html").read_text()
    assert path.index("glue_text_classification.html") < path.index("llama_fsdp.html")
    trouble = (site / "troubleshooting.html").read_text()
    assert trouble.count("<h2") == 6 and "does not fit" in trouble and "would wait forever" in trouble


@pytest.mark.docs_executed
@pytest.mark.parametrize("path", NOTEBOOK_FILES, ids=lambda p: p.stem)
def test_executed_page_shows_a_plot_and_says_where_it_came_from(browser, base_url, path):
    """Only on a site built with DOCS_EXECUTE=1 (`make docs` runs it there)."""
    with open_page(browser, f"{base_url}/notebooks/{path.stem}.html") as page:
        images = page.locator("article div.cell_output img")
        assert images.count() >= 1, "no plot on the page"
        assert images.first.evaluate("img => img.complete && img.naturalWidth > 100")
        # no output that needs a script from outside the site to show (Jupyter widgets load theirs from a CDN)
        assert page.locator("script[type='application/vnd.jupyter.widget-view+json']").count() == 0
        note = page.locator("article div.admonition.note").first.inner_text()
        assert "Outputs from a CPU smoke run" in note and "SMOKE_TEST=1" in note
        assert page.locator("article div.what-you-should-see").count() == 0  # the outputs show it
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{path.stem}-executed.png"), full_page=True)


# ---- Markdown and cell tags, on a fixture site built with the same conf.py ----

# A 1x1 PNG: enough for Sphinx to copy it and for the browser to decode it.
PIXEL = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


def _fixture_notebook() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata.language_info = {"name": "python", "pygments_lexer": "ipython3"}
    stream = functools.partial(nbformat.v4.new_output, "stream", name="stdout")
    nb.cells = [
        nbformat.v4.new_markdown_cell(
            "# Fixture page\n\n"
            "> [!NOTE]\n> A GitHub-style note.\n\n"
            ":::{warning}\nA MyST warning.\n:::\n\n"
            "| setting | value |\n|---|---|\n| `NUM_WORKERS` | 2 |\n\n"
            "![a pixel](pixel.png)\n\n"
            "```bash\npapermill in.ipynb out.ipynb -p SMOKE_TEST True\n```\n"
        ),
        nbformat.v4.new_code_cell(
            "shown_input = 1\nprint('output of a shown cell')",
            outputs=[stream(text="output of a shown cell\n")],
        ),
        nbformat.v4.new_code_cell(
            "removed_cell_input = 2",
            outputs=[stream(text="removed cell output\n")],
            metadata={"tags": ["remove-cell"]},
        ),
        nbformat.v4.new_code_cell(
            "removed_input_only = 3",
            outputs=[stream(text="output whose input is removed\n")],
            metadata={"tags": ["remove-input"]},
        ),
    ]
    return nb


def _fixture_site(tmp_path):
    """A site source with one page, the fixture notebook, and the label each notebook page's note links to."""
    src = tmp_path / "src"
    (src / "notebooks").mkdir(parents=True)
    (src / "index.md").write_text(
        "# Fixture\n\n(run-the-notebooks)=\n## Run\n\n```{toctree}\nnotebooks/page\n```\n"
    )
    nbformat.write(_fixture_notebook(), src / "notebooks" / "page.ipynb")
    (src / "notebooks" / "pixel.png").write_bytes(PIXEL)
    return src


def _with_what_you_should_see(src) -> None:
    """The fixture notebook with its "What you should see" cell, as each notebook has after training."""
    path = src / "notebooks" / "page.ipynb"
    nb = nbformat.read(path, as_version=4)
    cell = nbformat.v4.new_markdown_cell(
        "**What you should see** in smoke mode:\n\n- **A fixture result.** What the page's smoke run prints.\n"
    )
    cell.metadata["tags"] = ["what-you-should-see"]
    nb.cells.append(cell)
    nbformat.write(nb, path)


def test_notebook_markdown_and_cell_tags_render(browser, tmp_path):
    src = _fixture_site(tmp_path)
    _with_what_you_should_see(src)
    proc = sphinx_build(src, tmp_path / "html")
    assert proc.returncode == 0, proc.stderr[-4000:]
    with serve(tmp_path / "html") as url, open_page(browser, f"{url}/notebooks/page.html") as page:
        article = page.locator("article")
        box = article.locator("div.admonition.what-you-should-see")
        assert box.is_visible() and "A fixture result." in box.inner_text()
        assert article.locator("div.admonition.note").count() == 1  # the alert
        assert article.locator("div.admonition.note", has_text="A GitHub-style note.").is_visible()
        assert article.locator("div.admonition.warning", has_text="A MyST warning.").is_visible()
        assert article.locator("table td", has_text="NUM_WORKERS").is_visible()
        image = article.locator("img[alt='a pixel']")
        assert image.is_visible() and image.evaluate("img => img.complete && img.naturalWidth === 1")
        assert article.locator("div.highlight-bash span").count() > 0  # highlighted shell
        assert article.locator("div.cell_input span.n", has_text="shown_input").is_visible()  # Python
        text = article.inner_text()
        assert "output of a shown cell" in text
        assert "removed_cell_input" not in text and "removed cell output" not in text  # remove-cell
        assert "removed_input_only" not in text  # remove-input hides the code...
        assert "output whose input is removed" in text  # ...and keeps what it printed


BROKEN = {
    "cross_reference": (
        "index.md",
        "See {doc}`a page that does not exist <nowhere>`.\n",
        r"unknown document: '?nowhere",
    ),
    "lexer": ("index.md", "```nosuchlanguage\ncode\n```\n", r"nosuchlanguage"),
    "notebook_json": ("page.ipynb", '{"cells": [', r"page\.ipynb.*invalid notebook \(NotJSONError\)"),
    "notebook_schema": (
        "page.ipynb",
        '{"cells": [{"cell_type": "code"}], "nbformat": 4, "nbformat_minor": 5}',
        r"page\.ipynb.*invalid notebook \(ValidationError\)",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_warnings_fail_the_build(tmp_path, case):
    file, text, message = BROKEN[case]
    src = tmp_path / "src"
    src.mkdir()
    (src / "index.md").write_text("# Broken\n\n```{toctree}\npage\n```\n")
    (src / "page.md").write_text("# A page\n")
    (src / file).write_text((src / file).read_text() + text if file == "index.md" else text)
    if file.endswith(".ipynb"):
        (src / "page.md").unlink()
    proc = sphinx_build(src, tmp_path / "html")
    assert proc.returncode != 0
    assert re.search(message, proc.stderr), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr  # a warning naming the file, not a crash


def test_a_notebook_page_without_what_you_should_see_fails_the_build(tmp_path):
    src = _fixture_site(tmp_path)
    proc = sphinx_build(src, tmp_path / "html")
    assert proc.returncode != 0
    assert re.search(r'page\.ipynb.*no "What you should see" box: tag one Markdown cell', proc.stderr), (
        proc.stderr[-3000:]
    )
    assert "Traceback" not in proc.stderr
