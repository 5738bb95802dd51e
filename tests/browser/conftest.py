"""Browser tests: Playwright (sync API) driving Debian's Chromium (/usr/bin/chromium, installed by
`make test`; Playwright's own browser downloads are never used) against one real Trainyard
(tests/integration/cluster.py: redis, daphne, Celery control worker + beat, relay, two node agents)
shared by the browser modules."""
from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest

from tests.integration.cluster import Cluster

CHROMIUM = Path(os.environ.get("TRAINYARD_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]
PASSWORD = "integration-pw-1"  # what Cluster gives `admin` (TRAINYARD_ADMIN_PASSWORD)
# Screenshots for the README when set (e.g. TRAINYARD_SCREENSHOTS=docs): docs/screenshot-job.png, ...
SCREENSHOTS = os.environ.get("TRAINYARD_SCREENSHOTS", "")


@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    """One cluster for every browser module (a module may override it: test_preemption.py), so
    each module's tests must not count on a cluster no other module used: they find their own
    jobs by id or name."""
    c = Cluster(tmp_path_factory.mktemp("browser-cluster"))
    c.env["TRAINYARD_WEBHOOK_ALLOW"] = "127.0.0.1"  # the notifications page's hooks reach test receivers only
    try:
        c.start()
        for path in ("/static/css/trainyard.css", "/static/js/job.js", "/static/vendor/uplot-1.6.32/uPlot.esm.js"):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{c.port}{path}", timeout=10) as resp:
                    ok = resp.status == 200
            except OSError:
                ok = False
            if not ok:
                pytest.fail(f"daphne does not serve {path}: the pages would load without their CSS and scripts. "
                            "controlplane/asgi.py must serve /static/ (e.g. wrap the HTTP app in "
                            "django.contrib.staticfiles.handlers.ASGIStaticFilesHandler)")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def browser(cluster):
    # Depends on the cluster so it closes first: Cluster.stop() kills every child process left,
    # and Chromium and Playwright's driver are children of this process too.
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: the browser tests drive Debian's Chromium. `make test` installs it "
                    "(as root: apt-get install -y chromium); never `playwright install`.")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the Python package playwright is missing: run `make venv` (it is pinned in requirements.lock)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def login(page, base: str, username: str = "admin", password: str = PASSWORD) -> None:
    page.goto(f"{base}/accounts/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    with page.expect_navigation():
        page.click("button[type=submit]")


@pytest.fixture(scope="module")
def base(cluster) -> str:
    return f"http://127.0.0.1:{cluster.port}"


@pytest.fixture(scope="module")
def context(browser, base):
    """A logged-in browser context (desktop size) shared by the module's tests."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    ctx.set_default_timeout(30_000)
    page = ctx.new_page()
    login(page, base)
    assert page.url == f"{base}/", page.url
    page.close()
    yield ctx
    ctx.close()


@pytest.fixture
def page(context):
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    # JS exceptions and console errors, except the browser's note on 4xx documents (a 400 answer
    # to an invalid spec is expected).
    p.on("console", lambda msg: msg.type == "error" and not msg.text.startswith("Failed to load resource")
         and errors.append(msg.text))
    p.js_errors = errors
    yield p
    p.close()


def screenshot(page, name: str) -> None:
    if SCREENSHOTS:
        out = Path(SCREENSHOTS)
        out.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out / name), full_page=True)
