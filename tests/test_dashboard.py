"""The web dashboard (``pgq dashboard``, :mod:`pgq.dashboard`).

* Its JSON routes against a real database through Starlette's TestClient:
  queues with lengths, rates and pause states, a job with its history and
  dead letter, dead letters, typed 400/404 errors, and the 403 of every
  action without the token (or on a read-only dashboard).
* The CLI's refusal to listen beyond loopback without a token.
* The page in a real browser: Debian's ``chromium``, headless, driven by
  Playwright (skipped, with the reason, when either is missing), against a
  real 3-node cluster and a real ``pgq dashboard`` process. It clicks
  through queues, a job, dead letters (requeue refused without the token,
  done with it), pause/resume and nodes, and saves screenshots to
  ``test-results/screenshots/dashboard-*.png`` (``$PGQ_SCREENSHOTS`` to put them
  elsewhere). Every process it starts (cluster, server, browser, producer
  thread) is stopped at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

import pgq
from pgq.cli import main as cli_main
from pgq.dashboard import create_app
from pgq.localcluster import LocalCluster, free_port

from .conftest import wait_until

try:
    from playwright.sync_api import Page, expect, sync_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    sync_playwright = None  # type: ignore[assignment]

TOKEN = "dashboard-s3cret"
ROOT = Path(__file__).resolve().parent.parent
# A results folder (not committed); the README's copies in docs/screenshots
# are refreshed with PGQ_SCREENSHOTS=docs/screenshots.
SCREENSHOTS = Path(os.environ.get("PGQ_SCREENSHOTS") or ROOT / "test-results" / "screenshots")
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


def _browser_missing() -> str | None:
    if sync_playwright is None:
        return "playwright is not installed (pip install -e '.[test]')"
    if CHROMIUM is None:
        return "Debian's chromium is not installed (apt-get install chromium, as root; `make install` does it)"
    return None


needs_browser = pytest.mark.skipif(_browser_missing() is not None, reason=_browser_missing() or "")
needs_cluster = pytest.mark.skipif(os.environ.get("PGQ_TEST_DOCKER") == "1",
                                   reason="the cluster tests run one embedded server per node")


# ------------------------------------------------------------ routes


class Clock:
    """A monotonic clock the test moves (the dashboard's rates use it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def boards(dsn: str) -> Iterator[Callable[..., TestClient]]:
    """Dashboards over the test database: make(token=None, clock=None)."""
    opened: list[TestClient] = []

    def make(token: str | None = None, clock: Clock | None = None) -> TestClient:
        app = create_app(pgq.AsyncClient(dsn), token, **({"clock": clock} if clock else {}))
        client = TestClient(app)
        client.__enter__()
        opened.append(client)
        return client

    try:
        yield make
    finally:
        for client in opened:
            client.__exit__(None, None, None)


def queue_of(overview: dict[str, Any], name: str) -> dict[str, Any]:
    return next(q for q in overview["queues"] if q["name"] == name)


def test_the_overview_shows_queues_lengths_rates_and_pause(boards, client):
    clock = Clock()
    board = boards(clock=clock)
    client.add_jobs("emails", [b"a", b"b", b"c"], retry=30)
    first = board.get("/api/overview").json()
    emails = queue_of(first, "emails")
    assert (emails["length"], emails["paused"], emails["jobs_in"]) == (3, "none", 3)
    assert emails["in_rate"] is None and emails["oldest_age"] >= 0  # one sample: no rate yet
    assert first["nodes"] == [] and first["clustered"] is False  # no node process: single node
    assert (first["dead_letters"], first["actions"]) == (0, False)
    client.add_jobs("emails", [b"d"] * 4, retry=30)
    client.get_job("emails", count=2)
    clock.now += 2
    emails = queue_of(board.get("/api/overview").json(), "emails")
    assert (emails["length"], emails["active"], emails["in_rate"], emails["out_rate"]) == (5, 2, 2.0, 1.0)


def test_rates_after_a_quiet_spell_are_not_the_spells_average(boards, client):
    # Nobody looked for an hour: the next rate was the average over the
    # hour (an idle queue showed its old traffic), not over ~10 s.
    clock = Clock()
    board = boards(clock=clock)
    client.add_job("quiet", b"x", retry=30)
    board.get("/api/overview")
    client.add_jobs("quiet", [b"x"] * 3600, retry=30)  # during the hour nobody looked
    clock.now += 3600
    assert queue_of(board.get("/api/overview").json(), "quiet")["in_rate"] is None  # was 1.0/s
    clock.now += 2
    assert queue_of(board.get("/api/overview").json(), "quiet")["in_rate"] == 0.0  # idle now


def test_a_queue_shows_its_stats_and_next_jobs(boards, client):
    ids = client.add_jobs("q/with slash", ["x" * 500, "<b>y</b>"], retry=30)
    data = boards().get("/api/queues/" + "q/with slash").json()
    assert data["queue"]["len"] == 2 and data["queue"]["pause"] == "none"
    assert [j["id"] for j in data["jobs"]] == ids
    assert data["jobs"][0]["truncated"] and len(data["jobs"][0]["body"]) == 200
    assert data["jobs"][1] == {"id": ids[1], "body": "<b>y</b>", "truncated": False}
    missing = boards().get("/api/queues/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"] == "NoJobError"


def test_lists_read_only_the_first_bytes_of_bodies(boards, client, monkeypatch):
    # A queue's view and the dead letters' page read whole bodies (QPEEK,
    # the page of dead letters) to show 200 characters, every 2 s while a
    # page was open (found by a read-only review). Now they read a prefix:
    # what reaches the preview is bounded, whatever the bodies' size.
    from pgq import dashboard

    seen: list[int] = []
    preview = dashboard._preview

    def watched(prefix, size):
        seen.append(len(prefix))
        return preview(prefix, size)

    monkeypatch.setattr(dashboard, "_preview", watched)
    big = ["é" * (2 * 1024 * 1024), b"\xff" * (4 * 1024 * 1024)]  # 4 MiB of text, 4 MiB of binary
    ids = client.add_jobs("heavy", big, retry=30)
    board = boards()
    jobs = board.get("/api/queue?name=heavy").json()["jobs"]
    assert jobs[0]["body"] == "é" * 200 and jobs[0]["truncated"]
    assert jobs[1]["body_base64"].startswith("////") and jobs[1]["truncated"]
    client.get_job("heavy", count=2)
    assert client.dead_letter(*ids, reason="too big") == 2
    dead = board.get("/api/dead-letters?queue=heavy").json()["dead_letters"]
    assert [d["id"] for d in dead] == ids and dead[0]["body"] == "é" * 200 and dead[0]["reason"] == "too big"
    assert seen and max(seen) <= dashboard.PREVIEW_BYTES


def test_a_job_shows_its_details_history_and_dead_letter(boards, client):
    board = boards()
    queued = client.add_job("jobs", b"\xff\x00binary", retry=30)
    data = board.get(f"/api/jobs/{queued}").json()
    assert data["job"]["state"] == "queued" and data["job"]["body_base64"] == "/wBiaW5hcnk="
    assert data["job"]["created_at"].startswith("20") and data["history"] == []
    done = client.add_job("jobs", "done", retry=30)
    client.get_job("jobs", count=5)
    client.ack_job(done)
    history = board.get(f"/api/jobs/{done}").json()
    assert history["job"] is None or history["job"]["state"] == "acked"
    assert [h["outcome"] for h in history["history"]] == ["acked"]
    client.dead_letter(queued, reason="cannot parse")
    dead = board.get(f"/api/jobs/{queued}").json()
    assert dead["dead_letter"]["reason"] == "cannot parse"
    assert dead["dead_letter"]["body_base64"] == "/wBiaW5hcnk="
    assert [h["outcome"] for h in dead["history"]] == ["dead"]


@pytest.mark.parametrize("method,path,body,status,kind", [
    ("GET", "/api/jobs/not-an-id", None, 400, "BadIdError"),
    ("GET", "/api/jobs/D-00000000-++++++++++++++++++++++++-0001", None, 404, "NoJobError"),
    ("GET", "/api/dead-letters?count=0", None, 400, "InvalidArgumentError"),
    ("GET", "/api/dead-letters?after=x", None, 400, "InvalidArgumentError"),
    ("POST", "/api/dead-letters/requeue", b"{not json", 400, "bad_request"),
    ("POST", "/api/dead-letters/requeue", b"{}", 400, "bad_request"),
    ("POST", "/api/dead-letters/requeue", b'{"ids": "one"}', 400, "bad_request"),
    ("POST", "/api/queues/q/pause", b'{"state": "sideways"}', 400, "bad_request"),
    ("GET", "/static/../dashboard.py", None, 404, None),
    # Starlette's own refusals were plain text without the page's headers
    # (found by a read-only review): JSON like every other error now.
    ("GET", "/api/nope", None, 404, "not_found"),
    ("POST", "/api/overview", b"{}", 405, "method_not_allowed"),
    ("POST", "/api/queues/q/pause", b"\xff\xfe{", 400, "bad_request"),
])
def test_bad_input_gets_a_typed_4xx(boards, method, path, body, status, kind):
    board = boards(TOKEN)
    response = board.request(method, path, content=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == status
    assert response.headers["X-Frame-Options"] == "DENY"
    if kind:
        assert response.json()["error"] == kind and response.json()["message"]
    if body == b"\xff\xfe{":  # it said "a number in the request body has too many digits"
        assert response.json()["message"] == "the request body is not JSON in UTF-8"


def test_actions_are_refused_without_the_token(boards, client):
    job = client.add_job("pay", "card 42", retry=30)
    client.get_job("pay")
    client.dead_letter(job, reason="declined")
    read_only, guarded = boards(), boards(TOKEN)
    for board, headers, kind in [(read_only, {}, "read_only"),
                                 (read_only, {"Authorization": f"Bearer {TOKEN}"}, "read_only"),
                                 (guarded, {}, "forbidden"),
                                 (guarded, {"Authorization": "Bearer wrong"}, "forbidden")]:
        for path, body in [("/api/dead-letters/requeue", {"ids": [job]}), ("/api/queues/pay/pause", {"state": "all"})]:
            response = board.post(path, json=body, headers=headers)
            assert (response.status_code, response.json()["error"]) == (403, kind)
    assert client.pause("pay", "state") == "none" and len(client.dead_letters()) == 1  # nothing happened
    assert guarded.get("/api/overview").json()["actions"] is True


def test_requeue_and_pause_with_the_token(boards, client):
    job = client.add_job("pay", "card 42", retry=30)
    client.get_job("pay")
    client.dead_letter(job, reason="declined")
    board = boards(TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    listed = board.get("/api/dead-letters").json()["dead_letters"]
    assert [(d["id"], d["reason"], d["body"]) for d in listed] == [(job, "declined", "card 42")]
    assert board.get("/api/overview").json()["dead_letters"] == 1
    requeued = board.post("/api/dead-letters/requeue", json={"ids": [job]}, headers=auth).json()["requeued"]
    assert len(requeued) == 1 and client.show(requeued[0])["body"] == b"card 42"
    assert board.get("/api/dead-letters").json()["dead_letters"] == []
    paused = board.post("/api/queues/pay/pause", json={"state": "all"}, headers=auth).json()
    assert paused == {"queue": "pay", "paused": "all"}
    assert queue_of(board.get("/api/overview").json(), "pay")["paused"] == "all"
    board.post("/api/queues/pay/pause", json={"state": "none"}, headers=auth)
    assert client.pause("pay", "state") == "none"


def test_a_queues_requeue_says_when_dead_letters_are_left(boards, client, monkeypatch):
    # A queue's requeue takes one batch (1,000) in one transaction; it used
    # to leave the rest without a word. The batch is made 3 here.
    from pgq import dashboard

    monkeypatch.setattr(dashboard, "REQUEUE_BATCH", 3)
    jobs = client.add_jobs("bulk", [b"%d" % i for i in range(5)], retry=30)
    client.get_job("bulk", count=5)
    assert client.dead_letter(*jobs, reason="declined") == 5
    board = boards(TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    first = board.post("/api/dead-letters/requeue", json={"queue": "bulk"}, headers=auth).json()
    assert (len(first["requeued"]), first["more"]) == (3, True)
    page = board.get("/api/dead-letters?count=1").json()  # paging: one at a time, "next" to go on
    assert len(page["dead_letters"]) == 1 and page["next"] == page["dead_letters"][0]["seq"]
    last = board.get(f"/api/dead-letters?count=1&after={page['next']}").json()
    assert len(last["dead_letters"]) == 1 and last["dead_letters"][0]["seq"] > page["next"]
    second = board.post("/api/dead-letters/requeue", json={"queue": "bulk"}, headers=auth).json()
    assert (len(second["requeued"]), second["more"]) == (2, False)
    assert client.qlen("bulk") == 5
    too_many = board.post("/api/dead-letters/requeue", json={"ids": jobs[:4]}, headers=auth)
    assert too_many.status_code == 400 and "at most 3" in too_many.json()["message"]


def test_queues_named_dot_and_dotdot_are_reached_by_name(boards, client):
    # A browser resolves a path segment "." or ".." before sending it: the
    # page could neither open nor pause those queues. It uses ?name= now.
    client.add_job(".", "dot", retry=30)
    client.add_job("..", "dotdot", retry=30)
    board = boards(TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert board.get("/api/queue", params={"name": "."}).json()["queue"]["name"] == "."
    assert [j["body"] for j in board.get("/api/queue?name=..").json()["jobs"]] == ["dotdot"]
    paused = board.post("/api/queue/pause?name=..", json={"state": "all"}, headers=auth).json()
    assert paused == {"queue": "..", "paused": "all"} and client.pause("..", "state") == "all"
    assert client.pause(".", "state") == "none"
    nameless = board.get("/api/queue")
    assert nameless.status_code == 400 and '"name"' in nameless.json()["message"]


def test_the_page_is_locked_down(boards):
    page = boards().get("/")
    assert page.status_code == 200 and 'data-actions="false"' in page.text
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    assert 'data-actions="true"' in boards(TOKEN).get("/").text
    script = boards().get("/static/app.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert "innerHTML" not in script.text and "insertAdjacentHTML" not in script.text  # text nodes only
    assert boards().get("/static/style.css").status_code == 200


@pytest.mark.parametrize("args", [
    ["dashboard", "--listen", "0.0.0.0:7780"],
    ["node", "start", "--name", "n", "--bus", "127.0.0.1:1", "--dashboard", "0.0.0.0:7780"],
])
def test_listening_beyond_loopback_needs_a_token(dsn, args):
    env = {"PGQ_DASHBOARD_TOKEN_FILE": None, "PGQ_DASHBOARD": None}
    result = CliRunner().invoke(cli_main, [*args, "--dsn", dsn], env=env)
    assert result.exit_code == 2 and "(beyond loopback) needs a secret" in result.output


def test_a_dashboard_beyond_loopback_needs_the_token_to_read_too(dsn, client):
    # Only its actions needed the token: anyone who could reach the port
    # read job bodies and dead letters.
    job = client.add_job("secret", "card 4242", retry=30)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    app = create_app(pgq.AsyncClient(dsn), TOKEN, private=True)
    with TestClient(app) as board:
        for path in ("/api/overview", f"/api/jobs/{job}", "/api/queues/secret", "/api/dead-letters"):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                refused = board.get(path, headers=headers)
                assert (refused.status_code, refused.json()["error"]) == (401, "unauthorized"), path
                assert "card" not in refused.text
            assert board.get(path, headers=auth).status_code == 200, path
        assert "card 4242" in board.get(f"/api/jobs/{job}", headers=auth).text
        page = board.get("/")  # holds no data: it asks for the token
        assert page.status_code == 200 and 'data-private="true"' in page.text
        assert board.get("/static/app.js").status_code == 200
        assert board.get("/health").status_code == 200


@contextlib.contextmanager
def _dashboard_process(dsn: str, listen_host: str, token_dir: Path) -> Iterator[str]:
    """A real `pgq dashboard` process on ``dsn``, listening on ``listen_host``
    (0.0.0.0: beyond loopback, so its reads are private), with TOKEN; its
    base URL (over loopback), once it answers. Stopped on exit."""
    token_file = token_dir / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "pgq", "dashboard", "--listen", f"{listen_host}:{port}",
         "--token-file", str(token_file), "--dsn", dsn],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert process.poll() is None, process.stdout.read().decode()  # type: ignore[union-attr]
        return answers(base)

    try:
        wait_until(up, 30, message="the dashboard to answer")
        yield base
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _dashboard_beyond_loopback(dsn: str, tmp_path: Path) -> contextlib.AbstractContextManager[str]:
    return _dashboard_process(dsn, "0.0.0.0", tmp_path)


def test_pgq_dashboard_beyond_loopback_serves_its_data_with_the_token_only(dsn, tmp_path):
    with _dashboard_beyond_loopback(dsn, tmp_path) as base:
        assert call(base, "/api/overview")[0] == 401
        assert call(base, "/api/overview", token=TOKEN)[0] == 200


def test_a_loopback_dashboard_refuses_other_host_names(dsn):
    """DNS rebinding: a page elsewhere reaching 127.0.0.1 under its own name."""
    from pgq.dashboard import hosts_for

    assert hosts_for("0.0.0.0") is None  # beyond loopback: any name (a token guards actions)
    # Loopback as the CLI judges it: a name that merely begins with "127."
    # was loopback here and not there (reads then needed no token).
    assert hosts_for("127.foo.example") is None
    assert "[0:0:0:0:0:0:0:1]" in hosts_for("0:0:0:0:0:0:0:1")  # type: ignore[operator]
    assert "[0:0:0:0:0:0:0:1]" in hosts_for("[0:0:0:0:0:0:0:1]")  # type: ignore[operator]
    app = create_app(pgq.AsyncClient(dsn), allowed_hosts=hosts_for("127.0.0.1"))
    with TestClient(app, base_url="http://127.0.0.1:7780") as browser:
        assert browser.get("/api/overview").status_code == 200
        refused = browser.get("/api/overview", headers={"host": "attacker.example"})
        assert refused.status_code == 400 and refused.json()["error"] == "bad_host"
        assert browser.get("/api/overview", headers={"host": "[::1]:7780"}).status_code == 200


def test_a_port_in_use_is_one_line_and_status_1(dsn):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for command, role in ((["dashboard", "--listen"], "the dashboard"), (["serve", "--http"], "the HTTP API")):
            done = subprocess.run([sys.executable, "-m", "pgq", *command, f"127.0.0.1:{port}", "--dsn", dsn],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 1, done.stderr
            assert done.stderr.strip() == (f"error: cannot listen on 127.0.0.1:{port} for {role}: "
                                           "it is in use (another server there? choose another port)")
    # Two fronts on one free port: the second is refused at once, by name.
    # Each passed a bind-and-close probe, and the RESP server then failed
    # in its task while the HTTP API served (a node went on without it).
    from pgq.ports import free_port

    port = free_port()
    done = subprocess.run([sys.executable, "-m", "pgq", "serve", "--http", f"127.0.0.1:{port}",
                           "--resp", f"127.0.0.1:{port}", "--dsn", dsn],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (f"error: cannot listen on 127.0.0.1:{port} for the RESP port: "
                                   "it is in use (another server there? choose another port)")


def test_fronts_bind_addresses_as_the_servers_did():
    """The fronts' sockets are bound before anything serves
    (pgq.fronts.bind_fronts): `::` takes IPv6 only (uvicorn's and anyio's
    listeners set IPV6_V6ONLY; left to the sysctl it took IPv4 too, and
    clashed with a server on 0.0.0.0), an address is not filtered by
    AI_ADDRCONFIG (`::1` was refused on hosts with IPv6 on loopback only),
    and port 0 gives a name's addresses one port."""
    import socket

    from pgq.fronts import Fronts, bind_fronts, close_bound
    from pgq.ports import free_port

    port = free_port("0.0.0.0")  # the wildcard's port: free on every address
    bound = bind_fronts(Fronts(http=("::", port)))
    try:
        [six] = bound["http"]
        assert six.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
        with socket.socket() as four:  # the IPv4 wildcard on the same port is free
            four.bind(("0.0.0.0", port))
    finally:
        close_bound(bound)
    bound = bind_fronts(Fronts(resp=("", 0)))
    try:
        assert len({sock.getsockname()[1] for sock in bound["resp"]}) == 1
    finally:
        close_bound(bound)


def test_the_command_has_help():
    result = CliRunner().invoke(cli_main, ["dashboard", "--help"])
    assert result.exit_code == 0 and "--token-file" in result.output and "read-only" in result.output


# ----------------------------------------------------------- browser


def call(base: str, path: str, body: dict[str, Any] | None = None,
         token: str | None = None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(base + path, method="POST" if body is not None else "GET",
                                     data=json.dumps(body).encode() if body is not None else None)
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def answers(base: str) -> bool:
    try:
        return call(base, "/health")[0] == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[LocalCluster, str]]:
    """A real 3-node cluster; n1 also serves its read-only dashboard (--dashboard)."""
    local = LocalCluster(3, prefix="pgq-dashboard-")
    node_board = f"127.0.0.1:{free_port()}"
    local.nodes[0].env["PGQ_DASHBOARD"] = node_board
    try:
        local.start()
        wait_until(lambda: answers(f"http://{node_board}"), 30, message="the node's dashboard")
        yield local, f"http://{node_board}"
    finally:
        local.close()


@pytest.fixture(scope="module")
def dashboard(cluster, tmp_path_factory) -> Iterator[str]:
    """A real `pgq dashboard` process on n1's database, actions behind TOKEN."""
    local, _ = cluster
    with _dashboard_process(local.nodes[0].dsn, "127.0.0.1",
                            tmp_path_factory.mktemp("dashboard")) as base:
        yield base


@pytest.fixture
def page() -> Iterator[Page]:
    with sync_playwright() as playwright:  # type: ignore[misc]
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 760})
            yield context.new_page()
        finally:
            browser.close()


class Traffic:
    """A producer and a consumer on queue "events" (so rates show), stopped at the end."""

    def __init__(self, dsn: str) -> None:
        self.client = pgq.Client(dsn)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for _ in range(1200):  # at most two minutes
            if self.stopping.wait(0.1):
                return
            self.client.add_jobs("events", [b'{"kind": "click"}'] * 3, replicate=2, retry=30)
            jobs = self.client.get_job("events", count=2, nohang=True)
            if jobs:
                self.client.ack_job(*jobs)

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(30)
        self.client.close()


def shoot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"dashboard-{name}.png"), full_page=True)


@needs_cluster
def test_the_node_serves_its_read_only_dashboard(cluster):
    _, base = cluster
    wait_until(lambda: len(call(base, "/api/overview")[1]["nodes"]) == 3, 30, message="3 nodes")
    status, overview = call(base, "/api/overview")
    assert status == 200 and overview["clustered"] and not overview["actions"]
    assert {n["status"] for n in overview["nodes"]} == {"alive"}
    assert call(base, "/api/queues/x/pause", {"state": "all"}, token=TOKEN)[0] == 403


@needs_cluster
@needs_browser
def test_click_through_the_dashboard_in_a_browser(cluster, dashboard, page):
    local, _ = cluster
    expect.set_options(timeout=20_000)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    with pgq.Client(local.nodes[0].dsn) as client, Traffic(local.nodes[0].dsn):
        emails = client.add_jobs("emails", [json.dumps({"to": f"user{i}@example.com", "template": "welcome"})
                                            for i in range(5)], replicate=3, retry=60)
        hostile = client.add_job("emails", '<img src=x onerror="window.pwned=1"><b>not bold</b>',
                                 replicate=3, retry=60)
        client.add_jobs("reports", [b"monthly", b"weekly"], replicate=2, retry=60)
        acked = client.add_job("invoices", "invoice 7", replicate=3, retry=60)
        client.get_job("invoices")
        client.ack_job(acked)
        dead = client.add_job("payments", '{"card": "4242", "amount": 1200}', replicate=3, retry=60)
        client.get_job("payments")
        client.dead_letter(dead, reason="card declined")

        # Queues: names, lengths and live rates.
        page.goto(dashboard + "/")
        expect(page.locator('tr[data-queue="emails"] td.length')).to_have_text("6")
        expect(page.locator('tr[data-queue="reports"] td.length')).to_have_text("2")
        expect(page.locator('tr[data-queue="events"] td').nth(3)).to_have_text(re.compile(r"^[1-9][\d.]*/s$"))
        expect(page.locator("#dead-count")).to_have_text("1")

        # Pause and resume (the token is asked for once, kept for the tab).
        page.fill("#token", TOKEN)
        page.click("#token-form button")
        expect(page.locator("#mode")).to_have_text("actions unlocked")
        expect(page.locator("#token-form")).to_be_hidden()
        page.click('tr[data-queue="reports"] button.pause')
        expect(page.locator('tr[data-queue="reports"] td.paused')).to_have_text("all")
        assert client.pause("reports", "state") == "all"
        with pgq.Client(local.nodes[1].dsn) as other:  # PAUSE ... BCAST reached the other nodes
            wait_until(lambda: other.pause("reports", "state") == "all", 20, message="the pause on n2")
        shoot(page, "queues")
        page.click('tr[data-queue="reports"] button.resume')
        expect(page.locator('tr[data-queue="reports"] td.paused')).to_have_text("none")
        assert client.pause("reports", "state") == "none"
        page.click("#lock")
        expect(page.locator("#mode")).to_have_text("actions locked")

        # A job: from its queue's view, then by ID; bodies stay text.
        page.click('tr[data-queue="emails"] a.queue-link')
        expect(page.locator("#queue-jobs")).to_be_visible()
        page.click(f'tr[data-job="{emails[0]}"] a.job-link')
        expect(page.locator("#job-title")).to_have_text(emails[0])
        expect(page.locator('#job dd[data-field="state"]')).to_have_text("queued")
        expect(page.locator('#job dd[data-field="queue"]')).to_have_text("emails")
        expect(page.locator("#job pre.body")).to_have_text(json.dumps({"to": "user0@example.com",
                                                                       "template": "welcome"}))
        expect(page.locator('#job dd[data-field="nodes delivered"]')).to_have_text(re.compile(r"(\w+, ){2}\w+"))
        shoot(page, "job")
        page.fill("#job-id", hostile)
        page.click("#open-job button")
        expect(page.locator("#job pre.body")).to_have_text('<img src=x onerror="window.pwned=1"><b>not bold</b>')
        assert page.locator("#job img, #job pre b").count() == 0 and page.evaluate("window.pwned") is None
        page.fill("#job-id", acked)
        page.click("#open-job button")
        expect(page.locator("#history td.outcome")).to_have_text(["acked"])

        # Dead letters: requeue refused without the token, done with it.
        page.click("#nav-dead")
        row = page.locator(f'tr[data-dead="{dead}"]')
        expect(row.locator("td.reason")).to_have_text("card declined")
        shoot(page, "dead-letters")
        row.locator("button.requeue").click()
        expect(page.locator("#flash")).to_contain_text("Refused")
        expect(page.locator("#flash")).to_contain_text("token")
        expect(row).to_be_visible()
        assert client.qlen("payments") == 0
        page.fill("#token", TOKEN)
        page.click("#token-form button")
        row.locator("button.requeue").click()
        expect(page.locator("#flash")).to_contain_text("Requeued as")
        expect(page.locator("#no-dead")).to_be_visible()
        assert client.qlen("payments") == 1

        # Nodes: the three of the cluster, alive.
        page.click("#nav-nodes")
        expect(page.locator("#nodes tbody tr")).to_have_count(3)
        expect(page.locator("#nodes td.status")).to_have_text(["alive"] * 3)
        expect(page.locator('tr[data-node="n1"]')).to_contain_text("this node")
        shoot(page, "nodes")
    assert errors == []


@needs_browser
def test_dead_letters_are_paged_in_the_browser(dsn, client, tmp_path, page):
    # The page showed the first 100 dead letters and no way to the others,
    # whatever the count beside the menu said.
    jobs = client.add_jobs("graveyard", [b"%d" % i for i in range(101)], retry=30)
    client.get_job("graveyard", count=101)
    assert client.dead_letter(*jobs, reason="gave up") == 101
    expect.set_options(timeout=20_000)
    with _dashboard_process(dsn, "127.0.0.1", tmp_path) as base:
        page.goto(base + "/#dead")
        rows = page.locator("#dead-letters tbody tr")
        expect(rows).to_have_count(100)
        expect(page.locator("#dead-first")).to_have_count(0)
        first = {rows.nth(i).get_attribute("data-dead") for i in range(100)}
        page.click("#dead-next")
        expect(rows).to_have_count(1)
        expect(page.locator("#dead-next")).to_have_count(0)
        assert first | {rows.nth(0).get_attribute("data-dead")} == set(jobs)
        page.click("#dead-first")
        expect(page.locator("#dead-letters tbody tr")).to_have_count(100)


@needs_browser
def test_a_queue_named_dot_opens_in_the_browser(dsn, client, tmp_path, page):
    client.add_job(".", "dot", retry=30)
    expect.set_options(timeout=20_000)
    with _dashboard_process(dsn, "127.0.0.1", tmp_path) as base:
        page.goto(base + "/")
        page.click('tr[data-queue="."] a.queue-link')
        expect(page.locator('section[data-queue="."] #queue-jobs tbody tr')).to_have_count(1)


@needs_browser
def test_a_private_dashboard_asks_for_the_token_then_shows_its_queues(dsn, client, tmp_path, page):
    client.add_jobs("private", [b"a", b"b"], retry=30)
    expect.set_options(timeout=20_000)
    with _dashboard_beyond_loopback(dsn, tmp_path) as base:
        page.goto(base + "/")
        expect(page.locator("#mode")).to_have_text("locked: enter the token")
        expect(page.locator('tr[data-queue="private"]')).to_have_count(0)
        page.fill("#token", TOKEN)
        page.click("#token-form button")
        expect(page.locator('tr[data-queue="private"] td.length')).to_have_text("2")
        expect(page.locator("#mode")).to_have_text("actions unlocked")


def test_a_jobs_view_reads_history_from_its_creation_and_its_dead_letter_by_index(dsn):
    # Neither table has an index on id: the view scanned all of history (a
    # day, up to 10 million rows) and every dead letter, every 2 s while a
    # job was shown (found by a read-only review). With scans off, the
    # plans must still find them through indexes.
    import time

    from pgq import dashboard

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET enable_seqscan = off")
        for statement, params, index in (
                (dashboard.HISTORY, (time.time() - 5, "D-x"), "history_finished_at_idx"),
                (dashboard.DEAD_LETTER, ("D-x",), "dead_letters_id_idx")):
            plan = json.dumps(conn.execute("EXPLAIN (FORMAT JSON) " + statement, params).fetchone()[0])
            assert '"Seq Scan"' not in plan and index in plan, plan
