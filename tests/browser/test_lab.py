"""The workbench in a real browser: `make lab` serves the repository, headless Chromium drives it.

This is what a user does after `make lab`: the lab opens on notebook 00 with the repository in the
file browser; they run every cell and read the outputs; in notebook 02 they move the ring panel's
slider and watch its chart redraw; they run the fork notebook 03 and pick other cases in its sweep. The server is started by `make lab` itself (the Makefile's
target, with its root and notebook; the test adds only --no-browser, an address, a random token and
`expose_app_in_browser`), and the page opened is the one the server writes for a browser to open.
Chromium comes from Debian (`apt-get install chromium chromium-driver`); selenium drives it through
that chromedriver, so nothing is downloaded at test time; the tests skip where either is missing.

A panel redraws in place when moving its control replaces the chart inside its cell (the title read
from plotly's SVG changes, the cell keeps one chart and one controls output) and the kernel sends no
output of its own for it (what JupyterLab would put in the Log Console).

Screenshots go to $JFA_BROWSER_ARTIFACTS where set, else to a folder under pytest's temporary
directory; the run prints the folder. Autosave is off (a throwaway settings folder), and the tests
check the notebook files on disk are unchanged afterwards.
"""
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
START_HERE = "notebooks/00_start_here.ipynb"
PIPELINES = "notebooks/02_pipelines_and_buffers.ipynb"
JAGGED = "notebooks/03_jagged_attention.ipynb"
ROOT_ENTRIES = ("README.md", "docs", "tutorials", "results", "notebooks")  # what the file browser must list
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# Generous, bounded waits: a 2-core machine shared with other work starts the server, a kernel and
# the TLX compiles of the notebooks several times slower than a workstation.
SERVER_START_S = 180
NOTEBOOK_OPEN_S = 180
RUN_ALL_S = 420
REDRAW_S = 90
POLL_S = 0.5
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                  "--no-first-run", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--window-size=1400,2000")
# What the executed notebook 00 must show: the environment table, the t01 check (kernel or reference),
# and the compile-only report of the t01 kernel.
EXPECTED_TEXT = ("TLX kernels compile here", "scale_tiles_kernel @ sm_90")
T01_CHECK_LINES = ("t01 check passed", "t01 reference on CPU", "t01 kernel not run here")
# Signs of a widget or a figure that did not render.
BROKEN_OUTPUT = ("Error displaying widget", "Loading widget...", "model not found", "Traceback")
RING_PANEL = "jw.ring_panel()"
BUDGET_PANEL = "jw.budget_panel()"
SWEEP_PANEL = "lab.sweep()"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def _wait_for(condition, timeout_s: float, what: str, on_timeout=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(POLL_S)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}\n{on_timeout()}")


@pytest.fixture(scope="module")
def artifacts(request, tmp_path_factory) -> Path:
    """Where the screenshots go: $JFA_BROWSER_ARTIFACTS, else a temporary folder; printed either way."""
    folder = Path(os.environ.get("JFA_BROWSER_ARTIFACTS") or tmp_path_factory.mktemp("browser-artifacts"))
    folder.mkdir(parents=True, exist_ok=True)
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown whatever pytest captures
        print(f"\nbrowser test screenshots: {folder}")
    return folder


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    options.set_capability("unhandledPromptBehavior", "accept")  # a "leave the page?" prompt, should one come
    for flag in CHROMIUM_FLAGS + (f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def lab(browser, tmp_path_factory):
    """`make lab` (its venv taken as built, the test's Python as PY) on 127.0.0.1 with a random token.

    Yields the URL the server writes for a browser to open, the base URL and the token."""
    if shutil.which("make") is None:
        pytest.fail("make is not installed: the README's `make lab` needs it")
    tmp = tmp_path_factory.mktemp("lab")
    token, port = secrets.token_hex(16), _free_port()
    settings = tmp / "settings" / "@jupyterlab"
    for plugin, values in {
        "docmanager-extension/plugin": {"autosave": False},
        # Every cell attached and rendered: the default windowing may skip cells out of view, and the
        # test reads the outputs from the page.
        "notebook-extension/tracker": {"windowingMode": "none"},
        "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    }.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    runtime = tmp / "runtime"
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"), JUPYTER_RUNTIME_DIR=str(runtime))
    lab_args = (f"--no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port={port} --IdentityProvider.token={token}"
                " --LabApp.expose_app_in_browser=True")
    log = tmp / "lab.log"
    with log.open("w") as log_file:
        # Its own process group: make, the server and its kernels end together.
        server = subprocess.Popen(["make", "--no-print-directory", "-o", ".venv/.installed", "lab",
                                   f"PY={sys.executable}", f"LAB_ARGS={lab_args}"],
                                  cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def answering():
            if server.poll() is not None:
                pytest.fail(f"make lab exited with {server.returncode}:\n{_log_tail(log)}")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as response:
                    return response.status == 200
            except OSError:
                return False
        _wait_for(answering, SERVER_START_S, f"make lab to answer on {base}", lambda: _log_tail(log))
        opened = _wait_for(lambda: sorted(runtime.glob("jpserver-file-to-run-*-open.html")), SERVER_START_S,
                           "the server's page to open", lambda: _log_tail(log))
        url = re.search(r'url=([^"]+)"', opened[0].read_text()).group(1)
        yield url, base, token
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


# ---- the page ------------------------------------------------------------------------------------
CURRENT = "window.jupyterapp.shell.currentWidget"


def _page_text(driver) -> str:
    return driver.execute_script("return document.body ? document.body.innerText : ''")[-4000:]


def _open(driver, url: str, path: str):
    """Open `url` and wait until it shows the notebook `path` with a running kernel. Documents the
    page has open are marked clean first (autosave is off), so leaving the page asks nothing."""
    driver.execute_script("""
        const app = window.jupyterapp;
        if (app) for (const w of app.shell.widgets('main')) if (w.context) w.context.model.dirty = false;""")
    driver.get(url)
    ready = f"""
        const w = window.jupyterapp && {CURRENT};
        return !!(w && w.context && w.context.path === arguments[0] && w.sessionContext
                  && w.sessionContext.session && w.sessionContext.session.kernel
                  && w.content && w.content.widgets.length > 0);"""
    _wait_for(lambda: driver.execute_script(ready, path), NOTEBOOK_OPEN_S, f"{path} and its kernel",
              lambda: _page_text(driver))
    assert driver.execute_script(f"return {CURRENT}.content.notebookConfig.windowingMode") == "none", \
        "the settings folder did not reach JupyterLab"


def _run_all(driver):
    driver.execute_script(f"""
        const app = window.jupyterapp;
        {CURRENT}.sessionContext.ready
          .then(() => app.commands.execute('notebook:clear-all-cell-outputs'))
          .then(() => app.commands.execute('notebook:run-all-cells'));""")


def _all_cells_ran(driver) -> bool:
    """Every code cell has an execution count and the kernel is idle."""
    return driver.execute_script(f"""
        const w = {CURRENT};
        const cells = w.content.widgets.filter(c => c.model.type === 'code');
        return w.sessionContext.session.kernel.status === 'idle'
               && cells.every(c => c.model.executionCount !== null);""")


def _outputs_text(driver) -> str:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('.jp-OutputArea-output')).map(e => e.innerText).join('\\n')")


def _mark_cell(driver, source: str, mark: str) -> None:
    """Tag the DOM node of the code cell whose source contains `source` as data-jfa-cell=`mark`."""
    found = driver.execute_script(f"""
        const cell = {CURRENT}.content.widgets.find(
            c => c.model.type === 'code' && c.model.sharedModel.getSource().includes(arguments[0]));
        if (!cell) return false;
        cell.node.setAttribute('data-jfa-cell', arguments[1]);
        return true;""", source, mark)
    assert found, f"no code cell holds {source!r}"


def _cell_state(driver, mark: str) -> dict:
    """What a user sees in the tagged cell: its outputs, its plotly charts' titles, its text."""
    return driver.execute_script("""
        const node = document.querySelector(`[data-jfa-cell="${arguments[0]}"]`);
        const plots = Array.from(node.querySelectorAll('.js-plotly-plot'));
        return {
            outputs: node.querySelectorAll('.jp-OutputArea-child').length,
            plots: plots.length,
            titles: plots.map(p => { const t = p.querySelector('.gtitle'); return t ? t.textContent : ''; }),
            bars: plots.map(p => p.querySelectorAll('.point').length),
            widgets: node.querySelectorAll('.jupyter-widgets.widget-hbox, .widget-hbox').length,
            text: Array.from(node.querySelectorAll('.jp-OutputArea-output')).map(e => e.innerText).join('\\n'),
        };""", mark)


def _listen_for_stray_outputs(driver) -> None:
    """Record every output the kernel sends outside an execution of a cell: a display, stream or
    result whose parent is no execute request is what JupyterLab shows in the Log Console."""
    driver.execute_script(f"""
        window.jfaStray = [];
        {CURRENT}.sessionContext.session.kernel.iopubMessage.connect((_, msg) => {{
            const type = msg.header.msg_type;
            const parent = msg.parent_header && msg.parent_header.msg_type;
            if (['display_data', 'execute_result', 'stream', 'error'].includes(type) && parent !== 'execute_request')
                window.jfaStray.push(type + ' (parent: ' + parent + '): ' + JSON.stringify(msg.content).slice(0, 200));
        }});""")


def _screenshot(driver, artifacts: Path, name: str, mark: str | None = None) -> None:
    if mark is not None:
        driver.execute_script(
            "document.querySelector(`[data-jfa-cell=\"${arguments[0]}\"]`).scrollIntoView({block: 'start'});", mark)
        time.sleep(1)  # let plotly finish drawing what scrolled in
    driver.save_screenshot(str(artifacts / f"{name}.png"))


def _digest(path: str) -> str:
    return hashlib.sha256((REPO / path).read_bytes()).hexdigest()


# ---- the tests -----------------------------------------------------------------------------------
def _run_marked(driver, lab, path: str, marks: dict, what: str) -> str:
    """Open `path` in the lab, mark the cells whose source holds marks' keys, run every cell and
    return the outputs' text once all ran, asserting none failed and every output rendered."""
    url, base, token = lab
    _open(driver, f"{base}/lab/tree/{path}?token={token}", path)
    for source, mark in marks.items():
        _mark_cell(driver, source, mark)
    _run_all(driver)

    def ran():
        text = _outputs_text(driver)
        return text if "Traceback" in text or _all_cells_ran(driver) else None
    text = _wait_for(ran, RUN_ALL_S, f"every cell of {what}", lambda: _page_text(driver))
    assert "Traceback" not in text, f"a cell failed in JupyterLab:\n{text[-4000:]}"
    assert not [b for b in BROKEN_OUTPUT if b in text], f"an output did not render:\n{text[-4000:]}"
    return text


def test_make_lab_opens_start_here_with_the_repository_as_root(lab, browser, artifacts):
    from selenium.webdriver.common.by import By

    url, base, token = lab
    assert url == f"{base}/lab/tree/{START_HERE}?token={token}", f"make lab opens {url}"
    _open(browser, url, START_HERE)
    browser.execute_script("window.jupyterapp.commands.execute('filebrowser:activate')")

    def listing():
        return browser.execute_script(
            "return Array.from(document.querySelectorAll('.jp-DirListing-item .jp-DirListing-itemText'))"
            ".map(e => e.innerText.trim())")
    # The file browser opens in the notebook's folder, one level below the root ...
    _wait_for(lambda: Path(START_HERE).name in listing(), NOTEBOOK_OPEN_S, "the file browser to show notebooks/",
              lambda: _page_text(browser))
    home = browser.find_element(By.CSS_SELECTOR, ".jp-BreadCrumbs-home")
    assert home.get_attribute("title") == str(REPO), "the file browser's root is not the repository"
    # ... and its root, one click up, is the repository.
    home.click()
    _wait_for(lambda: all(entry in listing() for entry in ROOT_ENTRIES), NOTEBOOK_OPEN_S,
              f"the file browser to list {ROOT_ENTRIES} at the root", lambda: _page_text(browser))
    _screenshot(browser, artifacts, "00-opened")


def test_start_here_runs_in_jupyterlab(lab, browser, artifacts):
    url, base, token = lab
    on_disk = _digest(START_HERE)
    _open(browser, url, START_HERE)
    _run_all(browser)

    def finished():
        text = _outputs_text(browser)
        if "Traceback" in text:
            return text
        done = all(t in text for t in EXPECTED_TEXT) and any(t in text for t in T01_CHECK_LINES)
        return text if done and _all_cells_ran(browser) else None

    text = _wait_for(finished, RUN_ALL_S, "every cell of notebook 00", lambda: _page_text(browser))
    _screenshot(browser, artifacts, "00-ran")
    assert "Traceback" not in text, f"a cell failed in JupyterLab:\n{text[-4000:]}"
    assert "| TLX kernels run here |" not in text, "the environment table was not rendered as markdown"
    assert browser.execute_script("return document.querySelectorAll('.jp-RenderedMarkdown table').length") >= 2
    assert _digest(START_HERE) == on_disk, "the test modified the notebook"


def test_ring_panel_redraws_in_place(lab, browser, artifacts):
    """Notebook 02 run in full; the ring panel's depth slider moved from 2 to 3 by keyboard, as a
    user would; the chart in the panel's cell says depth 3 and 20 ticks (a third load in flight),
    its bars changed, and nothing lands outside the cell. Then the budget panel's stages slider."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    on_disk = _digest(PIPELINES)
    text = _run_marked(browser, lab, PIPELINES, {RING_PANEL: "ring", BUDGET_PANEL: "budget"}, "notebook 02")

    def drawn():
        state = _cell_state(browser, "ring")
        return state if state["plots"] == 1 and state["titles"][0] and state["widgets"] >= 1 else None
    before = _wait_for(drawn, REDRAW_S, "the ring panel's controls and chart", lambda: _page_text(browser))
    assert before["titles"][0].startswith("depth 2: 26 ticks"), before
    total_plots = browser.execute_script("return document.querySelectorAll('.js-plotly-plot').length")
    total_widgets = browser.execute_script("return document.querySelectorAll('.widget-slider, .widget-hslider').length")
    assert total_plots >= 3 and total_widgets >= 3, (total_plots, total_widgets)  # figures and sliders rendered
    _screenshot(browser, artifacts, "02-ring-depth-2", "ring")

    _listen_for_stray_outputs(browser)
    ring = browser.find_element(By.CSS_SELECTOR, '[data-jfa-cell="ring"]')
    handle = ring.find_elements(By.CSS_SELECTOR, ".noUi-handle")[0]  # the first slider: ring depth
    handle.click()
    handle.send_keys(Keys.ARROW_RIGHT)

    def redrawn():
        state = _cell_state(browser, "ring")
        return state if state["titles"] and state["titles"][0].startswith("depth 3: 20 ticks") else None
    after = _wait_for(redrawn, REDRAW_S, "the ring chart to say depth 3 (20 ticks)",
                      lambda: json.dumps(_cell_state(browser, "ring"), indent=1))
    _screenshot(browser, artifacts, "02-ring-depth-3", "ring")
    assert (after["plots"], after["outputs"]) == (1, before["outputs"]), (before, after)
    assert after["bars"] != before["bars"] or after["titles"] != before["titles"]
    assert browser.execute_script("return window.jfaStray") == [], "outputs went to the Log Console"

    # The text-only budget panel updates the same way.
    budget_before = _cell_state(browser, "budget")
    assert "shared memory" in budget_before["text"], budget_before
    budget = browser.find_element(By.CSS_SELECTOR, '[data-jfa-cell="budget"]')
    stages = next(s for s in budget.find_elements(By.CSS_SELECTOR, ".widget-slider, .widget-hslider")
                  if "K/V stages" in s.text)
    stages_handle = stages.find_element(By.CSS_SELECTOR, ".noUi-handle")
    stages_handle.click()
    stages_handle.send_keys(Keys.ARROW_RIGHT)
    assert "(2 stages)" in budget_before["text"], budget_before["text"]
    budget_after = _wait_for(lambda: (lambda s: s if "(3 stages)" in s["text"] else None)(
        _cell_state(browser, "budget")), REDRAW_S, "the budget table to count 3 stages",
        lambda: _cell_state(browser, "budget")["text"])
    assert budget_after["outputs"] == budget_before["outputs"], budget_after
    _screenshot(browser, artifacts, "02-budget-3-stages", "budget")
    assert browser.execute_script("return window.jfaStray") == [], "outputs went to the Log Console"
    assert _digest(PIPELINES) == on_disk, "the test modified the notebook"


def test_fork_notebook_runs_and_its_sweep_panel_redraws_in_place(lab, browser, artifacts):
    """Notebook 03 (the jagged forward and its fork exercise) run in full; then its sweep panel: the
    backward picked on the pass buttons, another suite from the dropdown; each time the one chart in
    the cell says so, and nothing lands outside the cell."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    on_disk = _digest(JAGGED)
    text = _run_marked(browser, lab, JAGGED, {SWEEP_PANEL: "sweep"}, "notebook 03")

    def drawn():
        state = _cell_state(browser, "sweep")
        return state if state["plots"] == 1 and state["titles"][0] and state["widgets"] >= 1 else None
    before = _wait_for(drawn, REDRAW_S, "the sweep panel's controls and chart", lambda: _page_text(browser))
    assert browser.execute_script("return document.querySelectorAll('.js-plotly-plot').length") >= 2
    _screenshot(browser, artifacts, "03-sweep-first", "sweep")
    _listen_for_stray_outputs(browser)
    cell = browser.find_element(By.CSS_SELECTOR, '[data-jfa-cell="sweep"]')

    def shows(*words: str, unlike: str):
        def check():
            state = _cell_state(browser, "sweep")
            title = state["titles"][0] if state["titles"] else ""
            return state if title != unlike and all(w in title for w in words) else None
        return _wait_for(check, REDRAW_S, f"the sweep chart's title to show {words}",
                         lambda: json.dumps(_cell_state(browser, "sweep"), indent=1))

    other_pass = next(b for b in cell.find_elements(By.CSS_SELECTOR, ".widget-toggle-button")
                      if b.text.strip() == "bwd")
    other_pass.click()
    backward = shows("bwd", unlike=before["titles"][0])
    _screenshot(browser, artifacts, "03-sweep-bwd", "sweep")
    suites = Select(cell.find_element(By.CSS_SELECTOR, ".widget-dropdown select"))
    other_suite = next(o.text for o in suites.options if o.text != suites.first_selected_option.text)
    suites.select_by_visible_text(other_suite)
    other = shows(other_suite, "bwd", unlike=backward["titles"][0])
    _screenshot(browser, artifacts, f"03-sweep-{other_suite}-bwd", "sweep")
    for state in (backward, other):
        assert (state["plots"], state["outputs"]) == (1, before["outputs"]), (before, state)
    assert other["bars"] != before["bars"] or other["titles"] != before["titles"]
    assert browser.execute_script("return window.jfaStray") == [], "outputs went to the Log Console"
    assert _digest(JAGGED) == on_disk, "the test modified the notebook"
