"""The job list (issue 25 section 3) in a real browser against a real cluster (no training: the jobs
are cancelled while queued): filter by tag through the form, sort by name both ways, page with the
filter kept, follow a tag chip, pick jobs on two pages and press "Compare selected", which opens
/compare/?jobs=<ids in the order picked>."""
from __future__ import annotations

import secrets
from urllib.parse import parse_qs, urlsplit

import pytest

from .conftest import screenshot

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def tagged(cluster):
    """27 cancelled jobs of this module only: tag `bt<hex>` on all, `bt<hex>-x` on every third."""
    tag = f"bt{secrets.token_hex(3)}"
    jobs = []
    for i in range(27):
        job = cluster.submit({"name": f"{tag}-{i:02d}", "tags": [tag] + ([f"{tag}-x"] if i % 3 == 0 else []),
                              "note": f"browser test job {i}", "train": {"steps": 5},
                              # no node carries this label: queued, never placed, then cancelled
                              "resources": {"labels": {"joblist-test": "nowhere"}}})
        status, body = cluster.request("POST", f"/api/v1/jobs/{job['id']}/cancel/")
        assert status == 202, body
        jobs.append(job)
    return tag, jobs


def names(page) -> list[str]:
    return [t.split(" · ", 1)[1] for t in page.locator("#job-table tbody tr[data-job] td:nth-child(2) > a").all_text_contents()]


def query(page) -> dict[str, list[str]]:
    return parse_qs(urlsplit(page.url).query)


def test_filter_sort_page_chip_and_compare(page, base, tagged):
    tag, jobs = tagged
    page.goto(f"{base}/jobs/")
    page.fill('#job-filters input[name="tag"]', tag)
    page.select_option('#job-filters select[name="page_size"]', "25")
    with page.expect_navigation():
        page.click('#job-filters button[type="submit"]')
    assert query(page)["tag"] == [tag] and query(page)["page_size"] == ["25"]
    assert len(names(page)) == 25 and page.locator("#page-of").text_content() == "page 1 of 2"
    assert names(page)[0] == f"{tag}-26"  # newest first
    assert page.locator("#job-count").text_content().startswith("27 jobs")

    with page.expect_navigation():
        page.click('#job-table a[data-sort="name"]')
    assert query(page)["ordering"] == ["name"] and query(page)["tag"] == [tag]
    assert names(page)[:3] == [f"{tag}-00", f"{tag}-01", f"{tag}-02"]
    with page.expect_navigation():
        page.click('#job-table a[data-sort="name"]')
    assert query(page)["ordering"] == ["-name"] and names(page)[0] == f"{tag}-26"
    screenshot(page, "screenshot-job-list.png")

    # pick the first row here (26), then one on page 2
    page.locator(f'#job-table tr[data-job="{jobs[26]["id"]}"] input.pick').check()
    button = page.locator("#compare-selected")
    assert button.is_disabled() and page.locator("#compare-count").text_content() == "(1)"
    with page.expect_navigation():
        page.click("#page-next")
    assert query(page)["ordering"] == ["-name"] and query(page)["tag"] == [tag] and query(page)["page"] == ["2"]
    assert names(page) == [f"{tag}-01", f"{tag}-00"]
    page.locator(f'#job-table tr[data-job="{jobs[0]["id"]}"] input.pick').check()
    assert button.is_enabled() and page.locator("#compare-count").text_content() == "(2)"

    # a chip filters by its tag, keeping the order
    with page.expect_navigation():
        page.locator(f'#job-table tr[data-job="{jobs[0]["id"]}"] a.chip', has_text=f"{tag}-x").click()
    assert query(page)["tag"] == [f"{tag}-x"] and query(page)["ordering"] == ["-name"] and "page" not in query(page)
    assert names(page) == [f"{tag}-{i:02d}" for i in range(24, -1, -3)]
    # the selection survived the navigation: the box is still checked, the count still 2
    assert page.locator(f'#job-table tr[data-job="{jobs[0]["id"]}"] input.pick').is_checked()
    assert page.locator("#compare-count").text_content() == "(2)"

    with page.expect_navigation():
        button.click()
    assert urlsplit(page.url).path == "/compare/"
    assert query(page)["jobs"] == [f"{jobs[26]['id']},{jobs[0]['id']}"]
    assert page.js_errors == [], page.js_errors


def test_bad_filter_shows_the_field_and_no_rows(page, base, tagged):
    page.goto(f"{base}/jobs/?status=DONE&tag={tagged[0]}")
    assert "status" in page.locator("#filter-errors").text_content()
    assert page.locator("#job-table tbody tr[data-job]").count() == 0
    assert page.js_errors == [], page.js_errors


def test_the_list_with_its_filters_fits_a_phone(browser, context, base, tagged):
    phone = browser.new_context(viewport={"width": 390, "height": 844}, storage_state=context.storage_state(),
                                is_mobile=True, has_touch=True)
    page = phone.new_page()
    try:
        page.goto(f"{base}/jobs/?tag={tagged[0]}&page_size=25")
        assert page.locator("#job-table tbody tr[data-job]").count() == 25
        sizes = page.evaluate("() => ({body: document.body.scrollWidth, doc: document.documentElement.scrollWidth,"
                              " inner: window.innerWidth})")
        assert sizes["body"] <= sizes["inner"] + 1 and sizes["doc"] <= sizes["inner"] + 1, sizes
    finally:
        phone.close()
