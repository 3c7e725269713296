"""The workbench in a real browser: JupyterLab serves 00_start_here, headless Chromium runs it.

This is what a user does after `make lab`: open the first notebook, run every cell, read the
outputs. The server starts the way the Makefile's `lab` target starts it (python -m jupyter lab
--no-browser), on 127.0.0.1 with a random token, from the repository root (with --allow-root
when the tests run as root, as CI does). Chromium comes from
Debian (`apt-get install chromium chromium-driver`); selenium drives it through that chromedriver,
so nothing is downloaded at test time. Autosave is off (a throwaway settings folder), and the test
checks the notebook file on disk is unchanged afterwards.
"""
import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = "notebooks/00_start_here.ipynb"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SERVER_START_S = 60
RUN_ALL_S = 90
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,2000")
# What the executed notebook must show: the environment table, the t01 check (kernel or reference),
# and the compile-only report of the t01 kernel.
EXPECTED_TEXT = ("TLX kernels compile here", "scale_tiles_kernel @ sm_90")
T01_CHECK_LINES = ("t01 check passed", "t01 reference on CPU")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_server(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"jupyter lab exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"jupyter lab did not answer {url} within {SERVER_START_S} s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def lab_server(tmp_path):
    token, port = secrets.token_hex(16), _free_port()
    settings = tmp_path / "settings" / "@jupyterlab"
    (settings / "docmanager-extension").mkdir(parents=True)
    (settings / "docmanager-extension" / "plugin.jupyterlab-settings").write_text(json.dumps({"autosave": False}))
    # Every cell attached and rendered: the default windowing may skip cells out of view, and the
    # test reads the outputs from the page.
    (settings / "notebook-extension").mkdir()
    (settings / "notebook-extension" / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    log = tmp_path / "lab.log"
    with log.open("w") as log_file:
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--port={port}", f"--ServerApp.token={token}", f"--ServerApp.root_dir={REPO}",
             "--LabApp.expose_app_in_browser=True"] + (["--allow-root"] if os.geteuid() == 0 else []),
            cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for_server(f"{base}/api/status?token={token}", server, log)
        yield base, token, log
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture
def browser(tmp_path):
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS + (f"--user-data-dir={tmp_path / 'chromium'}",):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    body = driver.execute_script("return document.body ? document.body.innerText : ''")
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}; the page shows:\n{body[-4000:]}")


def test_start_here_runs_in_jupyterlab(lab_server, browser):
    base, token, log = lab_server
    on_disk = hashlib.sha256((REPO / NOTEBOOK).read_bytes()).hexdigest()
    browser.get(f"{base}/lab/tree/{NOTEBOOK}?token={token}")

    app_ready = "return !!(window.jupyterapp && window.jupyterapp.shell.currentWidget" \
                " && window.jupyterapp.shell.currentWidget.sessionContext" \
                " && window.jupyterapp.shell.currentWidget.sessionContext.session" \
                " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel)"
    _wait(browser, lambda: browser.execute_script(app_ready), SERVER_START_S, "the notebook and its kernel")
    windowing = "return window.jupyterapp.shell.currentWidget.content.notebookConfig.windowingMode"
    assert browser.execute_script(windowing) == "none", "the settings fixture did not reach JupyterLab"
    browser.execute_script("""
        const app = window.jupyterapp;
        app.commands.execute('notebook:clear-all-cell-outputs')
           .then(() => app.commands.execute('notebook:run-all-cells'));""")

    def outputs_text() -> str:
        return browser.execute_script(
            "return Array.from(document.querySelectorAll('.jp-OutputArea-output'))"
            ".map(e => e.innerText).join('\\n')")

    def finished() -> str | None:
        text = outputs_text()
        done = all(t in text for t in EXPECTED_TEXT) and any(t in text for t in T01_CHECK_LINES)
        return text if done or "Traceback" in text else None

    text = _wait(browser, finished, RUN_ALL_S, "every cell's output")
    assert "Traceback" not in text, f"a cell failed in JupyterLab:\n{text[-4000:]}"
    assert "| TLX kernels run here |" not in text, "the environment table was not rendered as markdown"
    assert browser.execute_script("return document.querySelectorAll('.jp-RenderedMarkdown table').length") >= 2
    assert hashlib.sha256((REPO / NOTEBOOK).read_bytes()).hexdigest() == on_disk, "the test modified the notebook"
