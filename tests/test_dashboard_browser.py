"""The web dashboard in a real browser: headless Chromium over
the DevTools protocol (tests/browser.py) against a real gpupoold on a simulated GPU.

Logs in through the form with a user token, sees the GPU card free, starts a client lease
(tests/clients/hold_gpu.c) and sees the card turn `leased` with the holder within 3 s without a
reload, lets the client exit and sees `scrubbing` then `free`; the admin buttons are absent for the
user and present for an admin. Screenshots (overview free, leased, after, phone-sized, admin) are
kept in $GPUPOOL_ARTIFACTS_DIR/dashboard-browser, default pytest's tmp path plus a copy in
<build dir>/test-artifacts/dashboard-browser; the test prints where.
The markup it relies on: docs/dashboard.md, "For developers: the markup the tests rely on".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser import BrowserError, Chromium, Page, find_chromium
from conftest import BUILD_DIR, GpupoolServer, require
from test_e2e_leases import hold_gpu  # noqa: F401  (a fixture)

CARD = 'article.gpu-card[data-gpu="0"]'
ADMIN_ACTIONS = ("drain", "undrain", "clear", "end", "revoke", "create-token")
LEASED_WITHIN_S = 3.0
HOLD_MS = 5000  # long enough to see the lease and take a screenshot, then the client exits

# Installed in the page after login: records every state the GPU 0 card shows, with the time,
# from a MutationObserver (catches in-place rewrites and replaced elements alike) plus a 20 ms
# poll as a backstop; and a marker that a reload or navigation would lose.
RECORDER = """(() => {
  window.__gpupoolMarker = 'kept-%(marker)s';
  const seen = window.__gpupoolStates = [];
  const look = () => {
    const card = document.querySelector('%(card)s');
    const state = card ? card.getAttribute('data-state') : null;
    if (!seen.length || seen[seen.length - 1].state !== state)
      seen.push({state, t: Date.now(), text: card ? card.textContent.replace(/\\s+/g, ' ') : ''});
  };
  new MutationObserver(look).observe(document.body,
    {subtree: true, childList: true, attributes: true, characterData: true});
  setInterval(look, 20);
  look();
  return true;
})()"""




@pytest.fixture
def artifacts(tmp_path: Path) -> Iterator[Path]:
    """Where the screenshots go; copied to <build dir>/test-artifacts/ afterwards (pass or fail)."""
    base = os.environ.get("GPUPOOL_ARTIFACTS_DIR")
    folder = (Path(base) if base else tmp_path / "artifacts") / "dashboard-browser"
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\ndashboard screenshots: {folder}")
    yield folder
    if not base and any(folder.iterdir()):
        copy = BUILD_DIR / "test-artifacts" / "dashboard-browser"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(folder, copy)
        print(f"dashboard screenshots copied to {copy}")


@pytest.fixture
def chromium(tmp_path: Path, artifacts: Path) -> Iterator[Chromium]:
    binary = find_chromium()
    require(binary, "chromium not found: install Debian's chromium package "
                    "(`sudo apt-get install --no-install-recommends chromium`; scripts/bootstrap.sh "
                    "does it as root) or set GPUPOOL_CHROMIUM")
    browser = Chromium.start(tmp_path / "chromium", binary)
    try:
        yield browser
    finally:
        browser.close()
        if browser.console:
            (artifacts / "console.txt").write_text("\n".join(browser.console) + "\n")
        shutil.copy(browser.log_path, artifacts / "chromium.log")


def card_state(page: Page) -> str | None:
    return page.evaluate(f"document.querySelector('{CARD}')?.getAttribute('data-state') ?? null")


def card_text(page: Page) -> str:
    return str(page.evaluate(f"(document.querySelector('{CARD}')?.textContent ?? '')"
                             ".replace(/\\s+/g, ' ')"))


def login(page: Page, server: GpupoolServer, token: str) -> None:
    """Through the form, as a person would: a page without a session sends us to the login."""
    page.goto(server.http_url + "/ui/")
    page.wait_for("location.pathname === '/ui/login' && !!document.querySelector("
                  "'form[action=\"/ui/login\"] input[name=\"token\"]')",
                  what="the redirect to the login form")
    page.type_into('form[action="/ui/login"] input[name="token"]', token)
    page.click('form[action="/ui/login"] button[type="submit"], '
               'form[action="/ui/login"] input[type="submit"]')
    page.wait_for("location.pathname === '/ui/' && document.readyState === 'complete'",
                  what="the overview after logging in")


def summary(page: Page) -> str:
    return str(page.evaluate("document.getElementById('summary').innerText.replace(/\\s+/g, ' ')"))


def admin_buttons(page: Page) -> list[str]:
    sel = ", ".join(f'[data-action="{a}"]' for a in ADMIN_ACTIONS)
    return list(page.evaluate(f"[...document.querySelectorAll('{sel}')]"
                              ".map(e => e.getAttribute('data-action'))"))


def lease_of(server: GpupoolServer, pid: int) -> dict[str, Any] | None:
    for lease in server.get_json("/api/v1/leases?state=active")["leases"]:
        if lease["client"]["pid"] == pid:
            return lease
    return None


def test_dashboard_live_in_chromium(start_daemon: Any, native_build: Path,
                                    hold_gpu: Path,  # noqa: F811 (the fixture imported above)
                                    chromium: Chromium, artifacts: Path) -> None:
    server = start_daemon(build_dir=native_build)
    tenant = "browser-tenant"
    tenant_token = server.create_token(tenant)
    page = chromium.new_page(1280, 900)
    client: subprocess.Popen[str] | None = None
    try:
        # ---- login as a user, the overview with GPU 0 free
        login(page, server, server.token)
        page.wait_for(f"!!document.querySelector('{CARD}')", what="the GPU 0 card")
        page.wait_for("document.body.dataset.live === 'connected'", timeout=10,
                      what='<body data-live="connected"> (the event stream open)')
        page.wait_for(f"document.querySelector('{CARD}').dataset.state === 'free'", timeout=30,
                      what="GPU 0 free (first scrub done)")
        assert "free" in card_text(page), f"the state word is not in the card: {card_text(page)}"
        # counts with their nouns in the singular or plural they need
        assert summary(page).startswith("1 GPU: 1 free,"), summary(page)
        assert "· 0 active leases ·" in summary(page), summary(page)
        assert admin_buttons(page) == [], \
            f"admin controls in a user session: {admin_buttons(page)}"
        marker = f"{os.getpid()}-{time.monotonic_ns()}"
        page.evaluate(RECORDER % {"marker": marker, "card": CARD})
        page.screenshot(artifacts / "1-overview-free.png")

        # ---- a client takes the GPU: the card turns leased, in place, with the holder
        client = subprocess.Popen([str(hold_gpu), str(8 << 20), str(HOLD_MS), "7"],
                                  env=server.client_env({"GPUPOOL_TOKEN": tenant_token}),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        lease = None
        while lease is None:
            lease = lease_of(server, client.pid)
            if lease is None:
                if client.poll() is not None or time.monotonic() > deadline:
                    out, err = client.communicate(timeout=10)
                    pytest.fail(f"the client got no lease (exit {client.returncode}):\n"
                                f"{out}\n{err}", pytrace=False)
                time.sleep(0.02)
        page.wait_for(f"document.querySelector('{CARD}').dataset.state === 'leased'",
                      timeout=LEASED_WITHIN_S, what="the card to show the lease")
        states = page.evaluate("window.__gpupoolStates")
        shown = next(s["t"] for s in states if s["state"] == "leased") / 1000
        assert shown - lease["started"] <= LEASED_WITHIN_S, \
            f"the card showed the lease {shown - lease['started']:.2f} s after it started"
        text = card_text(page)
        assert "leased" in text, f"the state word is not in the card: {text}"
        assert tenant in text, f"the holder's token name {tenant!r} is not in the card: {text}"
        assert str(client.pid) in text, f"the holder's pid {client.pid} is not in the card: {text}"
        # The memory in use is what the client allocated (8 MiB, hold_gpu's first argument: a
        # multiple of the 2 MiB allocation granularity, so the GPU holds exactly that).
        page.wait_for(f"document.querySelector('{CARD}').innerText.includes('8.0 MiB / 80.0 GiB')",
                      timeout=10, what="the card to show the 8 MiB the client allocated")
        assert page.evaluate("window.__gpupoolMarker") == f"kept-{marker}", \
            "the page was reloaded or navigated (the marker set before is gone)"
        # the live update wrote the count's noun too
        page.wait_for("document.getElementById('summary').innerText.includes('1 active lease ·')",
                      timeout=5, what="the summary to say '1 active lease'")
        assert summary(page).startswith("1 GPU: 0 free, 1 leased,"), summary(page)
        page.screenshot(artifacts / "2-overview-leased.png")

        # the same page on a phone: no sideways scrolling
        page.viewport(390, 844, 2, mobile=True)
        page.screenshot(artifacts / "3-phone-leased.png")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"the overview is {width} px wide on a 390 px phone screen"
        page.viewport(1280, 900)

        # ---- the client exits: scrubbing, then free, still without a reload
        out, err = client.communicate(timeout=HOLD_MS / 1000 + 60)
        assert client.returncode == 0, f"hold_gpu failed ({client.returncode}):\n{out}\n{err}"
        page.wait_for(f"document.querySelector('{CARD}').dataset.state === 'free'", timeout=30,
                      what="the card to show GPU 0 free again")
        time.sleep(0.1)
        seen = page.evaluate("window.__gpupoolStates")
        seq = [s["state"] for s in seen]
        print("card states seen:", ", ".join(f"{s['state']} @{(s['t'] - seen[0]['t']) / 1000:.3f} s"
                                             for s in seen))
        after = seq[seq.index("leased"):]
        assert "scrubbing" in after and after.index("scrubbing") < len(after) - 1 \
            and after[-1] == "free", f"expected leased, scrubbing, free; the card showed {seq}"
        assert page.evaluate("window.__gpupoolMarker") == f"kept-{marker}", \
            "the page was reloaded or navigated (the marker set before is gone)"
        assert "free" in card_text(page), f"the state word is not in the card: {card_text(page)}"
        page.screenshot(artifacts / "4-overview-after.png")
        page.viewport(390, 844, 2, mobile=True)
        page.screenshot(artifacts / "5-phone-free.png")

        # ---- an admin session has the controls the user session lacked
        admin = chromium.new_page(1280, 900)
        login(admin, server, server.admin_token)
        admin.wait_for(f"!!document.querySelector('{CARD} [data-action=\"drain\"]')",
                       what='the drain button (button[data-action="drain"]) for an admin')
        # The last-day view (stored history, drawn at page load) has the lease's hour.
        bars_drawn = admin.evaluate("document.querySelectorAll('#last-day svg[data-series=\"day-0\"] "
                                    "rect.bar').length")
        assert bars_drawn >= 1, "the last-day chart of GPU 0 shows no leased hour"
        # The lease waited for no one (a queue wait of milliseconds, "0s"): its hour's wait bar
        # has no height (not the full height of a chart scaled to its own few milliseconds).
        heights = admin.evaluate("[...document.querySelectorAll('#last-day svg[data-series="
                                 "\"day-wait\"] rect.bar')].map(r => r.getAttribute('height'))")
        assert all(float(h) == 0 for h in heights), f"queue wait bars of a 0s wait: {heights}"
        assert "peak 0s" in admin.evaluate("document.getElementById('last-day').innerText")
        admin.screenshot(artifacts / "6-overview-admin.png")

        # ---- the lease history page, filtered by the tenant's token, has the ended lease
        admin.goto(server.http_url + f"/ui/history?token={tenant}")
        admin.wait_for(f"!!document.querySelector('#history tr[data-lease=\"{lease['id']}\"]')",
                       what=f"lease {lease['id']} in the history filtered by token {tenant}")
        row = admin.evaluate(f"document.querySelector('#history tr[data-lease=\"{lease['id']}\"]')"
                             ".innerText")
        assert tenant in row and str(client.pid) in row, row
        admin.screenshot(artifacts / "7-history.png")
    except (AssertionError, BrowserError, pytest.fail.Exception):
        try:
            page.screenshot(artifacts / "failure.png")
            (artifacts / "failure.html").write_text(page.html())
        except BrowserError:
            pass
        raise
    finally:
        if client is not None and client.poll() is None:
            client.kill()
            client.communicate()
