"""The notifications page (issue 25) in Chromium against the real cluster (its notifications worker
included): a webhook made from the form shows its secret once; a refused URL shows the field error
and saves nothing; an event the hook hears (admin's own quota changed through the API) is delivered
to a receiver this test runs, signed with that secret, and the page shows the delivery; pause and
delete from the row's buttons."""
from __future__ import annotations

import json
import time

import pytest

from tests.jobs.notify.sinks import Receiver, signature_ok

from .conftest import screenshot
from .test_fault_ui import api

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]


def rows(page) -> list[str]:
    return page.locator("#subscriptions tbody tr[data-id]").evaluate_all("rs => rs.map(r => r.dataset.id)")


def test_a_webhook_from_the_page_is_signed_delivered_logged_paused_and_deleted(page, base, cluster):
    with Receiver() as rx:
        page.goto(f"{base}/notifications/")
        assert page.locator('nav a[href="/notifications/"].active').count() == 1
        before = rows(page)

        # refused: a host the operator did not allow (the browser cluster allows 127.0.0.1 only)
        page.select_option("select[name=channel]", "webhook")
        page.fill("input[name=url]", "http://127.0.0.2:9/h")
        page.check('input[name=events][value="quota.changed"]')
        with page.expect_navigation():
            page.click("#new-subscription button[type=submit]")
        assert "does not allow" in page.locator("#errors").text_content() and rows(page) == before

        page.goto(f"{base}/notifications/")
        page.select_option("select[name=channel]", "webhook")
        page.fill("input[name=url]", rx.url("/ui"))
        page.check('input[name=events][value="quota.changed"]')
        page.check('input[name=events][value="node.lost"]')  # admin is staff: node events are offered
        with page.expect_navigation():
            page.click("#new-subscription button[type=submit]")
        secret = page.locator("#secret").text_content()
        assert len(secret) == 64
        screenshot(page, "screenshot-notifications.png")
        (hook_id,) = [r for r in rows(page) if r not in before]
        page.goto(f"{base}/notifications/")
        assert page.locator("#secret").count() == 0 and secret not in page.content()  # shown once

        status, _ = api(cluster, "PUT", "/api/v1/quotas/", {"user": "admin", "max_slots": 7})
        assert status == 200
        assert rx.arrived.wait(60), cluster.logs()
        (headers, raw, _), = rx.requests
        assert signature_ok(secret, raw, headers["x-trainyard-signature"])
        assert json.loads(raw)["quota"]["new"]["max_slots"] == 7

        row = page.locator(f'#subscriptions tr[data-id="{hook_id}"]')
        deadline = time.monotonic() + 30
        while row.locator('.delivery[data-status="delivered"]').count() == 0 and time.monotonic() < deadline:
            page.wait_for_timeout(500)
            page.reload()
        assert "quota.changed: delivered after 1 try (HTTP 200)" in row.text_content()

        with page.expect_navigation():
            row.locator('button[value="pause"]').click()
        assert "paused" in page.locator(f'#subscriptions tr[data-id="{hook_id}"]').text_content()
        with page.expect_navigation():
            page.locator(f'#subscriptions tr[data-id="{hook_id}"] button[value="delete"]').click()
        assert hook_id not in rows(page)
    assert page.js_errors == []
