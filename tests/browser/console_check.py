#!/usr/bin/env python3
"""The operator console (/console/ on the admin listener) in a real browser.

Run by tests/browser/run.sh, which starts the daemon (embedded emulator upstream, known tokens)
and passes its addresses. Controls are found the way a person finds them: by role and accessible
name, or by label. Each step fails on anything unexpected: a browser console error, an uncaught
page error, a failed request, an answer >= 400 that the step did not expect, a dialog. Waits are
on conditions, each bounded; there is no fixed sleep.

What it asserts, in order:
 1. signed out, a console page answers 303 to the sign-in page; the security headers; a wrong
    token is refused (401, an alert); the admin token signs in as an operator (cookie HttpOnly,
    SameSite=Strict, not Secure over plain HTTP, scoped to /console); a viewer token read-only;
 2. the agent-call sample posted through the webhook is on the queue page at position 1 with its
    bot, platform and user; the overview's figures;
 3. its conversation page: accept as "Kim", reply "Hello from Kim" (the emulator's journal gets
    the message once, though its form is sent twice), the conversation leaves the queue;
 4. a viewer sees no action forms; a forged POST with the viewer's session and its real CSRF
    token is refused (403), and so is the operator's POST without a CSRF token or with a wrong
    one; nothing changed;
 5. a dead letter: the release's Open API call is refused for good (a 400 injected at the
    emulator), the dead letter is on the outbox page (the viewer sees it without retry links and
    cannot retry it), the fault removed, "Retry N" and "Confirm" carry it out (gone from the dead
    letters, done in the admin API, the call in the journal); the overview's figures moved;
 6. a user message "<script>alert(1)</script>" (a webhook, and the emulator's user saying it) is
    shown as text on the conversation page; no script element, no dialog;
 7. a quarantined body with markup is shown as text on its record page;
 8. the rules page and its dry run;
 9. with JavaScript off: the queue's link, the conversation's accept, transfer and release forms;
10. the audit list names every action, who took it and how it ended; signing out ends the session
    on the server too;
11. at the end: no dead letter left, no call refused that the check did not fault.
Screenshots (full page, 1280x800 viewport) go to --screenshots.
"""

import argparse
import io
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
import uuid

from PIL import Image
from playwright.sync_api import expect, sync_playwright

CONVERSATION = "5c0e9b1f-2222-4d3e-9f10-000000000001"
BOT = "B7f3a2c"
USER = "web-visitor-8841"
# The emulator's second seeded conversation (a partner-messenger user), for the JavaScript-off pass.
KAKAO = "5c0e9b1f-2222-4d3e-9f10-000000000002"
KAKAO_USER = "kb-user-77a9f2"
MARKUP = "<script>alert(1)</script>"
QUARANTINED = "<script>alert(2)</script>"
# A flow of bot B7f3a2c in the emulator's seed (the sample's navigation comes from it).
FLOW = "3"
FIGURES_NOW = ["waiting", "oldest-wait"]
FIGURES_24H = [
    "joined-24h",
    "accepted-24h",
    "abandoned-24h",
    "abandonment-rate",
    "time-to-accept-p50",
    "time-to-accept-p90",
]
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 800}
# The largest screenshot accepted (they are committed in docs/console/).
SHOT_MAX = 400 * 1024
# Bounds of every wait (ms for Playwright, s for polls).
ACTION_MS = 15_000
POLL_S = 30.0


class CheckFailed(Exception):
    pass


def fail(message):
    raise CheckFailed(message)


def ensure(condition, message):
    if not condition:
        fail(message)


warned = set()


def warn(key, message):
    if key not in warned:
        warned.add(key)
        print(f"WARNING: {message}", flush=True)


# ---- Plain HTTP (webhook, emulator, admin API): outside the browser ----


def http(method, url, body=None, headers=None, timeout=10):
    data = None
    headers = dict(headers or {})
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers.setdefault("content-type", "application/json")
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def poll(what, probe, timeout=POLL_S, every=0.1):
    """`probe()` until it returns something truthy (returned), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")
        time.sleep(every)


class Daemon:
    def __init__(self, args):
        self.public = args.public.rstrip("/")
        self.admin = args.admin.rstrip("/")
        self.emulator = args.emulator.rstrip("/")
        self.admin_token = args.admin_token
        self.webhook_token = args.webhook_token
        self.fixtures = args.fixtures

    def console(self, path=""):
        return f"{self.admin}/console{path}"

    def fixture(self, name):
        with open(os.path.join(self.fixtures, name), encoding="utf-8") as f:
            return json.load(f)

    def webhook(self, delivery, raw=None):
        status, body = http(
            "POST",
            f"{self.public}/webhook/{self.webhook_token}",
            raw if raw is not None else delivery,
            {"content-type": "application/json"},
        )
        ensure(status == 200, f"the webhook answered {status}: {body[:300]!r}")
        return json.loads(body)

    def admin_get(self, path):
        status, body = http(
            "GET", f"{self.admin}{path}", headers={"authorization": f"Bearer {self.admin_token}"}
        )
        ensure(status == 200, f"GET {path} answered {status}: {body[:300]!r}")
        return json.loads(body)

    def journal(self):
        return self.admin_get("/admin/v1/emulator/journal")

    def emulator_post(self, path, body):
        status, answer = http("POST", f"{self.emulator}{path}", body)
        ensure(status == 200, f"POST {self.emulator}{path} answered {status}: {answer[:300]!r}")
        return json.loads(answer)

    def clear_faults(self):
        status, answer = http("DELETE", f"{self.emulator}/_emulator/faults")
        ensure(status == 204, f"DELETE /_emulator/faults answered {status}: {answer[:300]!r}")


def now_ms():
    return int(time.time() * 1000)


# ---- The browser side: every page watched ----


class Watch:
    """A page's problems: console errors, page errors, failed requests, unexpected >= 400
    answers, dialogs. `allow(status, url)` expects one answer (and the browser's console line
    about it), whenever it comes."""

    def __init__(self, name):
        self.name = name
        self.problems = []
        self.allowed = set()

    def attach(self, page):
        page.on("console", self._console)
        page.on("pageerror", lambda e: self.problems.append(f"uncaught page error: {e}"))
        page.on("dialog", self._dialog)
        page.on("requestfailed", self._failed)
        page.on("response", self._response)
        return page

    def _console(self, msg):
        if msg.type != "error":
            return
        url = (msg.location or {}).get("url", "")
        m = re.search(r"status of (\d{3})", msg.text)
        if m and (int(m.group(1)), url) in self.allowed:
            return
        self.problems.append(f"browser console error: {msg.text} (at {url or '?'})")

    def _dialog(self, dialog):
        self.problems.append(f"a dialog opened ({dialog.type}): {dialog.message!r}")
        dialog.dismiss()

    def _failed(self, request):
        self.problems.append(f"request failed: {request.method} {request.url}: {request.failure}")

    def _response(self, response):
        if response.status >= 400 and (response.status, response.url) not in self.allowed:
            self.problems.append(
                f"unexpected answer {response.status} to {response.request.method} {response.url}"
            )

    def allow(self, status, url):
        self.allowed.add((status, url))

    def check(self, where):
        if self.problems:
            listed = "\n  ".join(self.problems)
            self.problems = []
            fail(f"{self.name} context, {where}:\n  {listed}")


class Check:
    def __init__(self, args, browser):
        self.args = args
        self.d = Daemon(args)
        self.browser = browser
        self.watches = []
        self.shots = args.screenshots
        self.started = time.monotonic()

    # -- helpers --

    def step(self, title):
        for w in self.watches:
            w.check(f"before '{title}'")
        print(f"-- [{time.monotonic() - self.started:5.1f}s] {title}", flush=True)

    def context(self, name, javascript=True):
        ctx = self.browser.new_context(viewport=VIEWPORT, java_script_enabled=javascript)
        ctx.set_default_timeout(ACTION_MS)
        ctx.set_default_navigation_timeout(ACTION_MS)
        watch = Watch(name)
        self.watches.append(watch)
        page = watch.attach(ctx.new_page())
        return ctx, page, watch

    def shot(self, page, name):
        """A full-page screenshot, stored as a 256-colour PNG (flat colours and text: no
        visible loss, a third of the bytes)."""
        path = os.path.join(self.shots, f"{name}.png")
        png = page.screenshot(full_page=True, animations="disabled", caret="hide")
        image = Image.open(io.BytesIO(png)).convert("RGB")
        image = image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        image.save(path, optimize=True)
        size = os.path.getsize(path)
        ensure(size < SHOT_MAX, f"screenshot {path} is {size // 1024} KiB (over {SHOT_MAX // 1024})")
        print(f"   screenshot {path} ({image.width}x{image.height}, {size // 1024} KiB)", flush=True)

    def frame(self, page, tab, who):
        """The header every signed-in page has: the Console navigation, its six links (the
        current tab marked), who is signed in, a Sign out button."""
        nav = page.get_by_role("navigation", name="Console")
        for name in ["Overview", "Queue", "Outbox", "Quarantine", "Rules", "Audit"]:
            link = nav.get_by_role("link", name=name, exact=True)
            expect(link).to_have_count(1)
            if name == tab:
                expect(link).to_have_attribute("aria-current", "page")
            else:
                expect(link).not_to_have_attribute("aria-current", "page")
        expect(page.get_by_text(who, exact=True)).to_be_visible()
        expect(page.get_by_role("button", name="Sign out")).to_be_visible()

    def nav(self, page, name):
        page.get_by_role("navigation", name="Console").get_by_role(
            "link", name=name, exact=True
        ).click()
        page.wait_for_load_state()

    def sign_in(self, page, token, name):
        page.goto(self.d.console("/sign-in"))
        page.get_by_label("Token").fill(token)
        page.get_by_label("Your name").fill(name)
        page.get_by_role("button", name="Sign in").click()
        expect(page).to_have_url(self.d.console("/"))
        expect(page.get_by_role("heading", name="Overview", level=1)).to_be_visible()

    @staticmethod
    def csrf_of(page):
        """The session's CSRF token, as every page's sign-out form carries it."""
        field = page.locator('form[action="/console/sign-out"] input[type="hidden"][name="csrf"]')
        expect(field).to_have_count(1)
        token = field.get_attribute("value")
        ensure(token and len(token) >= 16, f"the sign-out form's CSRF token is {token!r}")
        return token

    @staticmethod
    def summary(page, term):
        """A value of the conversation page's summary list (`<dt>term</dt><dd>value</dd>`)."""
        return page.locator(f'dl dt:text-is("{term}") + dd')

    def figures(self, page):
        page.goto(self.d.console("/"))
        found = {}
        for name in FIGURES_NOW + FIGURES_24H:
            cell = page.locator(f'dd[data-figure="{name}"]')
            count = cell.count()
            ensure(count <= 1, f"overview: {count} figures named {name}")
            if count == 1:
                found[name] = cell.inner_text().strip()
        for name in FIGURES_NOW:
            ensure(name in found, f"overview: no <dd data-figure=\"{name}\">")
        missing = [n for n in FIGURES_24H if n not in found]
        ensure(not missing, f"overview: 24-hour figures missing: {missing} (found {found})")
        return found

    @staticmethod
    def count_of(text, what):
        m = re.fullmatch(r"\d+", text)
        ensure(m is not None, f"overview figure {what} is {text!r}, not a count")
        return int(text)

    def queue_row(self, page, conversation):
        """The queue table's row of `conversation`, waited for (the page reloaded, bounded)."""
        table = page.get_by_role("table", name="Waiting conversations")
        link = table.get_by_role("link", name=conversation, exact=True)

        def listed():
            page.goto(self.d.console("/queue"))
            return link.count() == 1

        poll(f"{conversation} on the queue page", listed)
        return table.get_by_role("row").filter(
            has=page.get_by_role("link", name=conversation, exact=True)
        )

    def not_in_queue(self, page, conversation):
        page.goto(self.d.console("/queue"))
        expect(page.get_by_role("heading", name="Queue", level=1)).to_be_visible()
        expect(page.get_by_role("link", name=conversation, exact=True)).to_have_count(0)

    def act(self, page, form, notice, fill=None, button=None):
        """Submit the conversation form named `form` (filling label -> value) and see its
        notice on the page it comes back to."""
        f = page.get_by_role("form", name=form)
        expect(f).to_be_visible()
        for label, value in (fill or {}).items():
            f.get_by_label(label, exact=True).fill(value)
        f.get_by_role("button", name=button or form, exact=True).click()
        page.wait_for_load_state()
        expect(page.get_by_role("status")).to_have_text(notice)

    def journal_call(self, what, match):
        def found():
            return [e for e in self.d.journal() if match(e)]

        return poll(f"the emulator's journal to show {what}", found)

    # -- the steps --

    def run(self):
        d = self.d
        op_ctx, op, op_watch = self.context("operator")
        # 1. Signed out; the sign-in page; roles.
        self.step("signed out: a console page redirects (303) to the sign-in page")
        for path in ["/", "/queue", f"/conversations/{CONVERSATION}", "/outbox", "/audit"]:
            r = op_ctx.request.get(d.console(path), max_redirects=0)
            ensure(r.status == 303, f"signed out, GET /console{path} answered {r.status}")
            ensure(
                r.headers.get("location") == "/console/sign-in",
                f"signed out, GET /console{path} goes to {r.headers.get('location')!r}",
            )
        resp = op.goto(d.console("/queue"))
        expect(op).to_have_url(d.console("/sign-in"))
        headers = resp.all_headers()
        csp = headers.get("content-security-policy", "")
        ensure("default-src 'none'" in csp, f"sign-in page CSP: {csp!r}")
        ensure("script-src" not in csp and "unsafe" not in csp, f"the CSP allows script: {csp!r}")
        ensure("frame-ancestors 'none'" in csp, f"sign-in page CSP: {csp!r}")
        ensure(headers.get("x-frame-options") == "DENY", f"X-Frame-Options: {headers}")
        ensure(headers.get("x-content-type-options") == "nosniff", f"nosniff: {headers}")
        expect(op.get_by_role("heading", name="Sign in to the console")).to_be_visible()
        expect(op.get_by_label("Token")).to_have_attribute("type", "password")
        expect(op.get_by_label("Your name")).to_have_attribute("type", "text")
        expect(op.locator("script")).to_have_count(0)
        self.shot(op, "sign-in")

        self.step("a wrong token is refused (401) with an alert")
        op.get_by_label("Token").fill("not-a-console-token-0000")
        op.get_by_label("Your name").fill("Kim")
        op_watch.allow(401, d.console("/sign-in"))
        with op.expect_response(
            lambda r: r.url == d.console("/sign-in") and r.request.method == "POST"
        ) as answer:
            op.get_by_role("button", name="Sign in").click()
        ensure(answer.value.status == 401, f"a wrong token answered {answer.value.status}")
        expect(op.get_by_role("alert")).to_contain_text("not valid")

        # 2. The agent-call sample, through the webhook (its event time made now, so waits and
        # the 24-hour figures are of today, not of the day the sample was written).
        self.step("the agent-call sample through the webhook")
        sample = d.fixture("agent-call-requested.json")
        ensure(
            sample["messages"][0]["data"]["conversation"]["id"] == CONVERSATION,
            "the sample is of another conversation",
        )
        sample["messages"][0]["timestamp"] = now_ms()
        answer = d.webhook(sample)
        ensure(answer.get("accepted") == 1, f"the webhook answered {answer}")

        self.step("sign in as operator Kim (the admin token)")
        self.sign_in(op, d.admin_token, "Kim")
        self.frame(op, "Overview", "Kim (operator)")
        cookies = {c["name"]: c for c in op_ctx.cookies()}
        session = cookies.get("hb_console")
        ensure(session is not None, f"no session cookie: {list(cookies)}")
        ensure(session["httpOnly"], "the session cookie is not HttpOnly")
        ensure(session["sameSite"] == "Strict", f"the session cookie is SameSite={session['sameSite']}")
        ensure(not session["secure"], "the session cookie is Secure over plain HTTP")
        ensure(session["path"] == "/console", f"the session cookie's path is {session['path']}")
        ensure("hb_console_sign_in" not in cookies, "the sign-in form's cookie outlived the sign-in")
        operator_csrf = self.csrf_of(op)

        self.step("the queue: the sample's conversation at position 1")
        self.nav(op, "Queue")
        row = self.queue_row(op, CONVERSATION)
        self.frame(op, "Queue", "Kim (operator)")
        table = op.get_by_role("table", name="Waiting conversations")
        expect(table.get_by_role("columnheader")).to_have_text(
            ["Position", "Conversation", "Bot", "Waiting", "Platform", "User"]
        )
        cells = row.get_by_role("cell")
        expect(cells).to_have_count(6)
        expect(cells.nth(0)).to_have_text("1")
        expect(cells.nth(1)).to_have_text(CONVERSATION)
        expect(cells.nth(2)).to_have_text(BOT)
        expect(cells.nth(3)).to_have_text(re.compile(r"^\d+s$|^\d+m \d+s$"))
        expect(cells.nth(4)).to_have_text("web")
        expect(cells.nth(5)).to_have_text(USER)
        refresh = op.locator('meta[http-equiv="refresh"]')
        expect(refresh).to_have_attribute("content", "10")
        self.shot(op, "queue")

        self.step("the overview: its health checks and figures")
        before = self.figures(op)
        self.frame(op, "Overview", "Kim (operator)")
        health = op.get_by_role("table").filter(has=op.get_by_role("columnheader", name="Check"))
        for name in ["store", "outbox", "upstream", "webhook", "folding", "outbox execution"]:
            expect(
                health.get_by_role("row").filter(
                    has=op.get_by_role("cell", name=name, exact=True)
                )
            ).to_have_count(1)
        ensure(self.count_of(before["waiting"], "waiting") >= 1, f"waiting: {before}")
        ensure(before["oldest-wait"] != "-", f"oldest wait with one waiting: {before}")
        per_bot = op.get_by_role("table", name="Waiting per bot")
        if per_bot.count():
            bot_row = per_bot.get_by_role("row").filter(
                has=op.get_by_role("link", name=BOT, exact=True)
            )
            expect(bot_row.get_by_role("cell").nth(1)).to_have_text("1")
        if "joined-24h" in before:
            ensure(self.count_of(before["joined-24h"], "joined-24h") >= 1, f"a join: {before}")
            ensure(
                re.fullmatch(r"\d+(\.\d+)?%|-", before["abandonment-rate"]) is not None,
                f"abandonment rate: {before}",
            )
        self.shot(op, "overview")

        # 3. The conversation: accept, reply.
        self.step("open the conversation from the queue (its link)")
        self.nav(op, "Queue")
        self.queue_row(op, CONVERSATION).get_by_role("link", name=CONVERSATION).click()
        page_url = re.compile(re.escape(d.console("/conversations/")) + r"5c0e9b1f(-|%2D)")
        expect(op).to_have_url(page_url)
        expect(op.get_by_role("heading", level=1)).to_have_text(f"Conversation {CONVERSATION}")
        self.frame(op, "Queue", "Kim (operator)")
        expect(self.summary(op, "Phase")).to_have_text("requested")
        expect(self.summary(op, "Agent")).to_have_text("-")
        expect(self.summary(op, "Bot")).to_have_text(BOT)
        expect(self.summary(op, "User key")).to_have_text(USER)
        for form in ["Accept", "Reply", "Release", "Transfer"]:
            f = op.get_by_role("form", name=form)
            expect(f).to_have_count(1)
            expect(f.locator('input[type="hidden"][name="csrf"]')).to_have_value(operator_csrf)
        expect(op.get_by_role("table", name="Messages")).to_be_visible()
        expect(op.get_by_role("heading", name="Timeline (newest first)")).to_be_visible()

        self.step("accept as Kim")
        self.act(op, "Accept", "Accepted: the conversation is yours.", {"Agent name": "Kim"})
        expect(self.summary(op, "Phase")).to_have_text("accepted")
        expect(self.summary(op, "Agent")).to_have_text("Kim")

        self.step("reply 'Hello from Kim': the emulator's journal receives it")
        reply_form = op.get_by_role("form", name="Reply")
        reply_key = reply_form.locator('input[name="key"]').get_attribute("value")
        self.act(op, "Reply", "Reply sent.", {"Reply": "Hello from Kim"}, button="Send reply")
        # The same form sent again (a double click, a reload that re-posts): one command.
        again = op_ctx.request.post(
            d.console(f"/conversations/{CONVERSATION}/reply"),
            form={"csrf": operator_csrf, "key": reply_key, "agent": "Kim", "text": "Hello from Kim"},
            max_redirects=0,
        )
        ensure(again.status == 303, f"the reply form sent again answered {again.status}")
        sent = self.journal_call(
            "the reply sent to the conversation",
            lambda e: e["method"] == "POST"
            and e["path"] == f"/openapi/conversation/{CONVERSATION}/message"
            and e["status"] == 200
            and (e.get("body") or {}).get("message", {}).get("text") == "Hello from Kim",
        )
        ensure(len(sent) == 1, f"the reply reached the service {len(sent)} times")

        def reply_shown():
            op.reload()
            return (
                op.get_by_role("table", name="Messages")
                .get_by_role("cell", name="Hello from Kim", exact=True)
                .count()
                == 1
            )

        poll("the reply in the conversation's Messages table", reply_shown)
        self.shot(op, "conversation")

        self.step("accepted: the conversation left the queue")
        self.not_in_queue(op, CONVERSATION)

        # 4. A viewer; forged and token-less POSTs.
        self.step("a viewer signs in (second browser context): no action forms")
        vw_ctx, vw, _ = self.context("viewer")
        self.sign_in(vw, self.args.viewer_token, "Vic")
        self.frame(vw, "Overview", "Vic (viewer)")
        viewer_csrf = self.csrf_of(vw)
        ensure(viewer_csrf != operator_csrf, "the viewer's and the operator's CSRF tokens are one")
        vw.goto(d.console(f"/conversations/{CONVERSATION}"))
        expect(vw.get_by_role("heading", level=1)).to_have_text(f"Conversation {CONVERSATION}")
        expect(self.summary(vw, "Phase")).to_have_text("accepted")
        expect(vw.get_by_role("main").get_by_role("button")).to_have_count(0)
        expect(vw.locator("main form")).to_have_count(0)
        for form in ["Accept", "Reply", "Release", "Transfer"]:
            expect(vw.get_by_role("form", name=form)).to_have_count(0)

        self.step("a forged release with the viewer's session and real CSRF token: 403")
        release = d.console(f"/conversations/{CONVERSATION}/release")
        r = vw_ctx.request.post(
            release, form={"csrf": viewer_csrf, "key": "forged-by-viewer"}, max_redirects=0
        )
        ensure(r.status == 403, f"the viewer's release answered {r.status}, not 403")

        self.step("the operator's POST without (or with a wrong) CSRF token: 403")
        r = op_ctx.request.post(release, form={"key": "no-csrf"}, max_redirects=0)
        ensure(r.status == 403, f"a release without its CSRF token answered {r.status}, not 403")
        r = op_ctx.request.post(
            release, form={"csrf": viewer_csrf, "key": "other-csrf"}, max_redirects=0
        )
        ensure(r.status == 403, f"a release with another session's token answered {r.status}")
        r = op_ctx.request.post(d.console("/sign-out"), form={"next": "/"}, max_redirects=0)
        ensure(r.status == 403, f"a sign-out without its CSRF token answered {r.status}")
        op.goto(d.console(f"/conversations/{CONVERSATION}"))
        expect(self.summary(op, "Phase")).to_have_text("accepted")
        expect(self.summary(op, "Agent")).to_have_text("Kim")

        # 5. A dead letter, retried from the console.
        self.step("a dead letter: the release's Open API call refused for good (400)")
        manual = f"/openapi/conversation/{CONVERSATION}/manual"
        d.emulator_post(
            "/_emulator/faults", {"fail_next": 1, "status": 400, "path_prefix": manual}
        )
        self.act(op, "Release", "Released to the bot.", button="Release to the bot")
        expect(self.summary(op, "Phase")).not_to_have_text("accepted")
        expect(self.summary(op, "Agent")).to_have_text("-")
        self.journal_call(
            "the release's call refused by the injected fault",
            lambda e: e["path"] == manual and e["status"] == 400 and e.get("fault") == "fail",
        )
        self.nav(op, "Outbox")
        dead = op.get_by_role("table", name="Dead letters")
        letter = dead.get_by_role("row").filter(
            has=op.get_by_role("link", name=CONVERSATION, exact=True)
        )

        def dead_letter_listed():
            op.reload()
            return letter.count() == 1

        poll("the dead letter on the outbox page", dead_letter_listed)
        self.frame(op, "Outbox", "Kim (operator)")
        expect(dead.get_by_role("columnheader")).to_have_text(
            ["#", "Action", "Conversation", "Reason", "Attempts", "Last attempt", "Act"]
        )
        cells = letter.get_by_role("cell")
        seq = cells.nth(0).inner_text().strip()
        ensure(seq.isdigit(), f"the dead letter's number is {seq!r}")
        expect(cells.nth(1)).to_have_text("set_manual")
        expect(cells.nth(3)).to_have_text(re.compile(r"\S"))
        expect(cells.nth(4)).to_have_text("1")
        expect(letter.get_by_role("link", name=f"Retry {seq}", exact=True)).to_be_visible()
        expect(letter.get_by_role("link", name=f"Discard {seq}", exact=True)).to_be_visible()
        matching = op.get_by_role("form", name="Retry matching")
        expect(matching.get_by_label("Reason contains")).to_be_visible()
        expect(matching.get_by_label("Queue contains")).to_be_visible()
        expect(matching.get_by_role("button", name="Retry all matching")).to_be_visible()
        expect(
            op.get_by_role("table", name="Pending actions").or_(op.get_by_text("Nothing pending."))
        ).to_be_visible()
        self.shot(op, "outbox")

        self.step("the viewer sees the dead letter without retry links, and cannot retry it")
        vw.goto(d.console("/outbox"))
        vw_dead = vw.get_by_role("table", name="Dead letters")
        expect(vw_dead.get_by_role("cell", name=seq, exact=True)).to_have_count(1)
        expect(vw.get_by_role("link", name=re.compile(r"^(Retry|Discard) \d+$"))).to_have_count(0)
        expect(vw.get_by_role("form", name="Retry matching")).to_have_count(0)
        r = vw_ctx.request.post(
            d.console(f"/dead-letters/{seq}/retry"), form={"csrf": viewer_csrf}, max_redirects=0
        )
        ensure(r.status == 403, f"the viewer's retry answered {r.status}, not 403")
        r = vw_ctx.request.post(
            d.console("/dead-letters-retry"), form={"csrf": viewer_csrf}, max_redirects=0
        )
        ensure(r.status == 403, f"the viewer's retry of all matching answered {r.status}")

        self.step("'Retry all matching' asks first (cancelled here)")
        matching.get_by_label("Reason contains").fill(cells.nth(3).inner_text().strip())
        matching.get_by_role("button", name="Retry all matching").click()
        expect(op.get_by_role("heading", name="Confirm", level=1)).to_be_visible()
        expect(op.get_by_role("main")).to_contain_text("(1 now)")
        expect(op.get_by_role("button", name="Confirm")).to_be_visible()
        op.get_by_role("link", name="Cancel").click()
        expect(op).to_have_url(d.console("/outbox"))
        expect(letter).to_have_count(1)

        self.step(f"the fault removed, 'Retry {seq}' and 'Confirm': the dead letter is carried out")
        d.clear_faults()
        letter.get_by_role("link", name=f"Retry {seq}", exact=True).click()
        expect(op.get_by_role("heading", name="Confirm", level=1)).to_be_visible()
        expect(op.get_by_role("main")).to_contain_text(f"Retry dead letter {seq}?")
        op.get_by_role("button", name="Confirm").click()
        expect(op.get_by_role("status")).to_have_text(
            "Dead letter retried: it is back in the outbox."
        )

        def letter_gone():
            op.goto(d.console("/outbox"))
            return (
                op.get_by_role("table", name="Dead letters")
                .get_by_role("cell", name=seq, exact=True)
                .count()
                == 0
            )

        poll(f"dead letter {seq} gone from the outbox page", letter_gone)

        def done():
            finished = d.admin_get("/admin/v1/outbox/done").get("finished", [])
            return [f for f in finished if str(f["entry"]["seq"]) == seq]

        finished = poll(f"dead letter {seq} done (GET /admin/v1/outbox/done)", done)
        ensure(finished[0]["outcome"] == "done", f"the retried letter ended {finished[0]}")
        self.journal_call(
            "the retried release carried out",
            lambda e: e["path"] == manual
            and e["status"] == 200
            and (e.get("body") or {}).get("enabled") is False,
        )

        self.step("released: not in the queue; the overview's figures moved")
        self.not_in_queue(op, CONVERSATION)
        after = self.figures(op)
        ensure(
            self.count_of(after["waiting"], "waiting")
            == self.count_of(before["waiting"], "waiting") - 1,
            f"waiting did not go down by one: before {before}, after {after}",
        )
        if "accepted-24h" in before and "accepted-24h" in after:
            ensure(
                self.count_of(after["accepted-24h"], "accepted-24h")
                == self.count_of(before["accepted-24h"], "accepted-24h") + 1,
                f"accepted-24h did not go up by one: before {before}, after {after}",
            )
            ensure(
                self.count_of(after["joined-24h"], "joined-24h") >= 1,
                f"joined-24h after a join: {after}",
            )
            ensure(
                after["abandoned-24h"] == before["abandoned-24h"],
                f"an accept counted as abandoned: before {before}, after {after}",
            )
            for p in ("time-to-accept-p50", "time-to-accept-p90"):
                ensure(
                    re.fullmatch(r"\d+s|\d+m \d+s|\d+h \d+m", after[p]) is not None,
                    f"{p} after an accept is {after[p]!r}",
                )
        print(f"   figures before {before}\n   figures after  {after}", flush=True)

        # 6. A message with markup, shown as text.
        self.step("a user message with markup: shown as text, no script, no dialog")
        message = d.fixture("message-received-text.json")
        message["id"] = str(uuid.uuid4())
        event = message["messages"][0]
        event["id"] = str(uuid.uuid4())
        event["timestamp"] = now_ms()
        inner = event["data"]["message"]
        ensure(inner["conversationId"] == CONVERSATION, "the message sample is of another conversation")
        inner["id"] = str(uuid.uuid4())
        inner["requestId"] = str(uuid.uuid4())
        inner["timestamp"] = now_ms()
        inner["data"]["text"] = MARKUP
        answer = d.webhook(message)
        ensure(answer.get("accepted") == 1, f"the webhook answered {answer}")
        # The Messages table reads the Open API: the emulator's user says it there too (and the
        # emulator delivers that event to the webhook as the service would).
        d.emulator_post(f"/_emulator/conversations/{CONVERSATION}/say", {"text": MARKUP})

        def markup_shown():
            op.goto(d.console(f"/conversations/{CONVERSATION}"))
            in_table = (
                op.get_by_role("table", name="Messages")
                .get_by_role("cell", name=MARKUP, exact=True)
                .count()
            )
            in_timeline = op.locator("article.event code", has_text=event["id"]).count()
            return in_table == 1 and in_timeline == 1

        poll("the message with markup on the conversation page", markup_shown)
        expect(op.get_by_text(MARKUP).first).to_be_visible()
        expect(op.locator("script")).to_have_count(0)
        html = op.content()
        ensure(MARKUP not in html, "the message's markup is in the page's HTML unescaped")
        ensure("&lt;script&gt;alert(1)&lt;/script&gt;" in html, "the message is not escaped text")

        # 7. Quarantine: a body that is no delivery, shown as text.
        self.step("quarantine: a body that is no delivery, shown as text on its record")
        answer = d.webhook(None, raw=QUARANTINED.encode())
        ensure(answer.get("status") == "quarantined", f"the webhook answered {answer}")
        self.nav(op, "Quarantine")
        self.frame(op, "Quarantine", "Kim (operator)")
        records = op.get_by_role("table", name="Quarantine records")
        record = records.get_by_role("link", name=re.compile(r"^Record \d+$")).first
        expect(record).to_be_visible()
        record.click()
        expect(op.get_by_role("heading", level=1)).to_have_text(re.compile(r"^Quarantine record \d+$"))
        expect(op.locator("pre.body")).to_have_text(QUARANTINED)
        expect(op.locator("script")).to_have_count(0)
        expect(op.get_by_role("button", name="Re-process")).to_be_visible()

        # 8. Rules and the dry run.
        self.step("rules: the rules in force, and the dry run")
        self.nav(op, "Rules")
        self.frame(op, "Rules", "Kim (operator)")
        rules = op.get_by_role("table", name="Rules in force")
        expect(rules.get_by_role("cell", name="agent-requested", exact=True)).to_have_count(1)
        dry = op.get_by_label("Event or delivery (JSON)")
        dry.fill("{not json")
        op.get_by_role("button", name="Test", exact=True).click()
        expect(op.get_by_role("alert")).to_contain_text("not an event or delivery")
        op.get_by_label("Event or delivery (JSON)").fill(json.dumps(sample, ensure_ascii=False, indent=1))
        op.get_by_role("button", name="Test", exact=True).click()
        expect(op.get_by_role("heading", level=3).first).to_contain_text(
            sample["messages"][0]["id"]
        )
        expect(op.locator("main pre").first).to_contain_text("MATCHED      agent-requested")
        expect(op.get_by_role("alert")).to_have_count(0)
        self.shot(op, "rules")

        # 9. JavaScript off: the same links and forms.
        self.step("JavaScript off: sign in, the queue's link, accept, transfer, release")
        nj_ctx, nj, _ = self.context("no-javascript", javascript=False)
        self.sign_in(nj, d.admin_token, "Lee")
        self.frame(nj, "Overview", "Lee (operator)")
        d.emulator_post(f"/_emulator/conversations/{KAKAO}/request-agent", {})
        self.nav(nj, "Queue")
        row = self.queue_row(nj, KAKAO)
        expect(row.get_by_role("cell").nth(5)).to_have_text(KAKAO_USER)
        row.get_by_role("link", name=KAKAO).click()
        expect(nj.get_by_role("heading", level=1)).to_have_text(f"Conversation {KAKAO}")
        self.act(nj, "Accept", "Accepted: the conversation is yours.", {"Agent name": "Lee"})
        expect(self.summary(nj, "Agent")).to_have_text("Lee")
        self.act(
            nj, "Transfer", "Transferred to the flow.", {"Flow id": FLOW}, button="Transfer to flow"
        )
        self.journal_call(
            f"the transfer to flow {FLOW} carried out",
            lambda e: e["method"] == "PUT"
            and e["path"] == f"/openapi/conversation/{KAKAO}/navigation"
            and e["status"] == 200
            and (e.get("body") or {}).get("flowId") == int(FLOW),
        )
        self.act(nj, "Release", "Released to the bot.", button="Release to the bot")
        self.not_in_queue(nj, KAKAO)

        # 10. The audit list; sign out.
        self.step("the audit list names every action")
        self.nav(op, "Audit")
        self.frame(op, "Audit", "Kim (operator)")
        audit = op.get_by_role("table", name="Console actions")
        expect(audit.get_by_role("columnheader")).to_have_text(
            ["When", "Who", "Role", "What", "Result"]
        )
        for who, what in [
            ("Kim", f"accept {CONVERSATION}"),
            ("Kim", f"reply {CONVERSATION}"),
            ("Kim", f"release {CONVERSATION}"),
            ("Kim", f"retry dead letter {seq}"),
            ("Lee", f"accept {KAKAO}"),
            ("Lee", f"transfer {KAKAO}"),
            ("Lee", f"release {KAKAO}"),
        ]:
            entries = audit.get_by_role("row").filter(
                has=op.get_by_role("cell", name=what, exact=True)
            )
            expect(entries.first).to_be_visible()
            listed = entries.count()
            if what.startswith("reply "):
                # Its form was sent twice (one message went out): both POSTs are listed, the
                # second (the newest) as the first one's answer.
                ensure(listed == 2, f"audit: {listed} rows for '{what}'")
                expect(entries.first.get_by_role("cell").nth(4)).to_have_text(
                    re.compile("the same form again")
                )
            else:
                ensure(listed == 1, f"audit: {listed} rows for '{what}'")
            entry = entries.last
            expect(entry.get_by_role("cell").nth(1)).to_have_text(who)
            expect(entry.get_by_role("cell").nth(2)).to_have_text("operator")
            expect(entry.get_by_role("cell").nth(4)).to_have_text(re.compile(r"^applied"))
        ensure(
            audit.get_by_role("cell", name="Vic", exact=True).count() == 0,
            "the viewer's refused attempts are in the audit list as actions",
        )
        self.shot(op, "audit")

        self.step("sign out: back to the sign-in page, the session ended on the server")
        old = {c["name"]: c["value"] for c in op_ctx.cookies()}["hb_console"]
        op.get_by_role("button", name="Sign out").click()
        expect(op).to_have_url(d.console("/sign-in"))
        ensure(
            "hb_console" not in {c["name"] for c in op_ctx.cookies()},
            "the session cookie is still in the browser after signing out",
        )
        r = op_ctx.request.get(
            d.console("/"), headers={"cookie": f"hb_console={old}"}, max_redirects=0
        )
        ensure(r.status == 303, f"the signed-out session still opens the console ({r.status})")

        self.step("every action carried out: no dead letter left, no other call refused")
        letters = d.admin_get("/admin/v1/dead-letters")
        ensure(letters.get("count") == 0, f"dead letters left: {letters}")
        refused = [
            (e["method"], e["path"], e["status"])
            for e in d.journal()
            if e["status"] >= 400 and e.get("fault") is None
        ]
        ensure(not refused, f"the service refused calls the check did not fault: {refused}")
        replies = [
            e
            for e in d.journal()
            if e["method"] == "POST"
            and (e.get("body") or {}).get("message", {}).get("text") == "Hello from Kim"
        ]
        ensure(len(replies) == 1, f"the reply, its form sent twice, was sent {len(replies)} times")

        for w in self.watches:
            w.check("at the end")
        for ctx in (op_ctx, vw_ctx, nj_ctx):
            ctx.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--public", required=True, help="the public listener, http://127.0.0.1:PORT")
    p.add_argument("--admin", required=True, help="the admin listener, http://127.0.0.1:PORT")
    p.add_argument("--emulator", required=True, help="the embedded emulator's address")
    p.add_argument("--admin-token", required=True)
    p.add_argument("--viewer-token", required=True)
    p.add_argument("--webhook-token", required=True)
    p.add_argument("--fixtures", required=True, help="../shared/fixtures/webhooks")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--screenshots", required=True, help="a directory for the PNGs")
    args = p.parse_args()
    os.makedirs(args.screenshots, exist_ok=True)
    expect.set_options(timeout=ACTION_MS)
    started = time.monotonic()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=args.chromium, args=CHROMIUM_ARGS, timeout=60_000
        )
        print(f"-- Chromium {browser.version}", flush=True)
        try:
            Check(args, browser).run()
        except CheckFailed as e:
            print(f"FAILED: {e}", file=sys.stderr, flush=True)
            return 1
        except AssertionError as e:
            # A failed `expect`: its message names the locator, what was expected and found.
            print(f"FAILED: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            browser.close()
    took = time.monotonic() - started
    gaps = f"; {len(warned)} warning(s) above" if warned else ""
    print(f"console browser check passed in {took:.1f} s{gaps}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
