#!/usr/bin/env python3
"""The web UI in headless Chromium (issue 18 item 2).

Starts `millrace standalone` on loopback ports of its own, a second executor that is then
killed (so the nodes page shows a node in grace), a third whose Hello a proxy repeats until
it is quarantined, runs jobs (one succeeds, one fails, one
prints for a while, one waits for a label nobody has), logs in through the real login form,
loads each page and checks what it shows, lifts a quarantine with the nodes page's button,
then logs out. Chromium is driven over the
DevTools protocol on a pipe (--remote-debugging-pipe), with the standard library only.

    python3 ci/ui_check.py --bin target/debug/millrace                # the check (CI)
    python3 ci/ui_check.py --bin target/debug/millrace --shots docs   # and the screenshots

Exits non-zero, naming the page and what was missing, when a check fails. Waits poll with a
bound; nothing asserts how long anything took.
"""

import argparse
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

WAIT_LIMIT = 60.0  # seconds any one wait may poll before the check fails


class CheckFailed(Exception):
    pass


def wait_for(what, probe, limit=WAIT_LIMIT):
    deadline = time.monotonic() + limit
    last = None
    while time.monotonic() < deadline:
        try:
            got = probe()
        except Exception as e:  # noqa: BLE001 - a probe that throws has not succeeded yet
            got, last = None, e
        if got:
            return got
        time.sleep(0.2)
    raise CheckFailed(f"timed out waiting for {what} (last error: {last})")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Api:
    def __init__(self, base, token):
        self.base, self.token = base, token

    def call(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def submit(self, **spec):
        status, v = self.call("POST", "/v1/jobs", spec)
        if status != 201:
            raise CheckFailed(f"submit {spec}: {status} {v}")
        return v["id"]

    def job(self, jid):
        return self.call("GET", f"/v1/jobs/{jid}")[1]


class StrikeProxy:
    """A TCP proxy between an executor and the mill that, while `strike` is set, repeats the
    executor's Hello frame (u32 length + body) on the same connection: a second Hello is a
    protocol violation (M2, M28), so `--quarantine-strikes` reconnects quarantine the node.
    With `strike` cleared it only forwards, so the node comes back after a lift."""

    def __init__(self, upstream):
        self.upstream = upstream
        self.strike = True
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @staticmethod
    def _exactly(sock, n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise OSError("closed")
            buf += chunk
        return buf

    def _serve(self, client):
        try:
            up = socket.create_connection(self.upstream)
            if self.strike:
                head = self._exactly(client, 4)
                hello = head + self._exactly(client, int.from_bytes(head, "big"))
                up.sendall(hello + hello)
        except OSError:
            client.close()
            return
        threading.Thread(target=self._pump, args=(up, client), daemon=True).start()
        self._pump(client, up)


class Chromium:
    """One headless Chromium, one page, driven over the DevTools pipe (fds 3 and 4)."""

    def __init__(self, binary, profile):
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def fds():
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        args = [binary, "--headless=new", "--remote-debugging-pipe", "--no-first-run",
                "--no-default-browser-check", "--disable-gpu", "--disable-extensions",
                "--hide-scrollbars", "--disable-dev-shm-usage", "--window-size=1280,800", f"--user-data-dir={profile}",
                "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses root with its sandbox
        self.proc = subprocess.Popen(args, preexec_fn=fds, pass_fds=(3, 4),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._id = 0
        self.events = []
        targets = self.send("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.send("Target.attachToTarget",
                                 {"targetId": page["targetId"], "flatten": True})["sessionId"]
        self.send("Page.enable", session=True)
        self.send("Runtime.enable", session=True)
        self.send("Emulation.setDeviceMetricsOverride", {
            "width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False}, session=True)

    def _read_message(self):
        while b"\0" not in self._buf:
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                raise CheckFailed("chromium closed its DevTools pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method, params=None, session=False):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        while True:
            m = self._read_message()
            if m.get("id") == self._id:
                if "error" in m:
                    raise CheckFailed(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def eval(self, expr):
        r = self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True,
                                           "awaitPromise": True}, session=True)
        if "exceptionDetails" in r:
            raise CheckFailed(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def goto(self, url):
        self.send("Page.navigate", {"url": url}, session=True)
        wait_for(f"{url} to load",
                 lambda: self.eval("document.readyState") == "complete"
                 and self.eval("location.href") is not None)

    def text(self):
        return self.eval("document.body ? document.body.innerText : ''") or ""

    def shoot(self, path):
        png = self.send("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(png))
        print(f"  screenshot {path}")

    def close(self):
        try:
            self.send("Browser.close")
        except CheckFailed:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def expect(page, b, *needles):
    """Waits until the page's text holds every needle; fails naming the missing one."""
    def holds():
        t = b.text()
        return all(n in t for n in needles)
    try:
        wait_for(f"{page} to show {needles}", holds)
    except CheckFailed:
        t = b.text()
        missing = [n for n in needles if n not in t]
        raise CheckFailed(f"{page}: missing {missing}; the page reads:\n{t}") from None
    print(f"  ok {page}: {', '.join(needles)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default="target/debug/millrace", help="the millrace binary")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    ap.add_argument("--shots", help="directory to save ui-jobs.png, ui-job.png, ui-nodes.png")
    a = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="millrace-ui-")
    procs = []
    browser = None
    try:
        http, execp = free_port(), free_port()
        data = os.path.join(tmp, "data")
        log = open(os.path.join(tmp, "standalone.log"), "w")
        env = dict(os.environ, RUST_LOG="warn")
        procs.append(subprocess.Popen(
            [a.bin, "standalone", "--data", data, "--http-listen", f"127.0.0.1:{http}",
             "--executor-listen", f"127.0.0.1:{execp}", "--node-id", "local",
             "--labels", "linux,x86_64", "--engine", "shell:4", "--reconnect-grace", "10m",
             # A small live buffer, so a reader that comes late to a burst gets a gap (E15).
             "--live-log-per-job", "16384"],
            stdout=log, stderr=log, env=env))
        base = f"http://127.0.0.1:{http}"
        wait_for("the node's /health", lambda: urllib.request.urlopen(base + "/health").status == 200)
        token = open(os.path.join(data, "api-token")).read().strip()
        api = Api(base, token)
        wait_for("node local ready", lambda: any(
            n["node"] == "local" and n["state"] == "ready"
            for n in api.call("GET", "/v1/nodes")[1]["nodes"]))

        # A second executor, killed: the nodes page shows it in grace with its deadline.
        other = subprocess.Popen(
            [a.bin, "executor", "--mill", f"127.0.0.1:{execp}", "--node-id", "builder-2",
             "--engine", "shell:2", "--labels", "arm64", "--data", os.path.join(tmp, "b2"),
             "--token-file", os.path.join(data, "token")],
            stdout=log, stderr=log, env=env)
        procs.append(other)
        wait_for("builder-2 ready", lambda: any(
            n["node"] == "builder-2" and n["state"] == "ready"
            for n in api.call("GET", "/v1/nodes")[1]["nodes"]))
        other.kill()
        other.wait()
        wait_for("builder-2 in grace", lambda: any(
            n["node"] == "builder-2" and n["state"] == "grace"
            for n in api.call("GET", "/v1/nodes")[1]["nodes"]))

        # A third executor whose connections repeat their Hello: quarantined (M28).
        proxy = StrikeProxy(("127.0.0.1", execp))
        procs.append(subprocess.Popen(
            [a.bin, "executor", "--mill", f"127.0.0.1:{proxy.port}", "--node-id", "flaky-3",
             "--engine", "shell:2", "--data", os.path.join(tmp, "f3"),
             "--token-file", os.path.join(data, "token"),
             "--backoff-min", "50ms", "--backoff-max", "300ms"],
            stdout=log, stderr=log, env=env))
        wait_for("flaky-3 quarantined", lambda: any(
            n["node"] == "flaky-3" and n["state"] == "quarantined"
            for n in api.call("GET", "/v1/nodes")[1]["nodes"]))
        proxy.strike = False

        ok = api.submit(command="echo compiling; echo build ok", owner="alice", repo="web",
                        labels=["linux"])
        bad = api.submit(command="echo running tests; echo '3 tests failed' >&2; exit 3",
                         owner="bob", repo="api")
        wait_for("the two short jobs to end", lambda: api.job(ok)["done"] and api.job(bad)["done"])
        if api.job(ok)["state"] != "success" or api.job(bad)["state"] != "failed":
            raise CheckFailed(f"short jobs: {api.job(ok)['state']}, {api.job(bad)['state']}")
        waiting = api.submit(command="nvidia-smi", owner="carol", repo="ml", labels=["gpu"])
        long = api.submit(
            command="for i in $(seq 1 3000); do echo \"step $i of 3000: building part $i\"; "
                    "sleep 0.1; done",
            owner="alice", repo="web", retries=1)
        burst = api.submit(command="seq 1 5000 | sed 's/^/burst line /'; sleep 300",
                           owner="dave", repo="logs")
        wait_for("the burst job's 60 KB", lambda: api.call(
            "GET", f"/v1/jobs/{burst}/log?cursor=0&max=1")[1]["end"] >= 60000)
        wait_for("the long job's output", lambda: api.call(
            "GET", f"/v1/jobs/{long}/log?cursor=0")[1]["len"] > 0)

        profile = os.path.join(tmp, "profile")
        browser = Chromium(a.chromium, profile)
        print("chromium:", a.chromium)

        # Not logged in: the page sends us to the login form; a wrong token stays there.
        browser.goto(base + "/ui/jobs")
        wait_for("the redirect to /ui/login",
                 lambda: browser.eval("location.pathname") == "/ui/login")
        expect("login", browser, "API token", "Log in")
        browser.eval("document.getElementById('token').value = 'wrong';"
                     "document.querySelector('form').submit()")
        expect("login (wrong token)", browser, "Wrong token.")
        # The real login: the form sets the HttpOnly cookie, which the page's script cannot read.
        browser.eval(f"document.getElementById('token').value = {json.dumps(token)};"
                     "document.querySelector('form').submit()")
        wait_for("the jobs page after login",
                 lambda: browser.eval("location.pathname") == "/ui/jobs")
        if browser.eval("document.cookie") != "":
            raise CheckFailed("the session cookie is readable by script (not HttpOnly)")

        expect("jobs", browser, f"j{ok}", f"j{bad}", f"j{long}", f"j{waiting}", "success",
               "failed", "running", "queued", "alice/web", "bob/api", "local")
        order = browser.eval("[...document.querySelectorAll('#jobs tbody tr td:first-child')]"
                             ".map(td => td.textContent)")
        if order != sorted(order, key=lambda s: -int(s[1:])):
            raise CheckFailed(f"jobs: not newest first: {order}")
        if a.shots:
            browser.shoot(os.path.join(a.shots, "ui-jobs.png"))

        browser.goto(base + "/ui/jobs?state=failed")
        expect("jobs?state=failed", browser, f"j{bad}", "failed", "exit 3")
        rows = browser.eval("document.querySelectorAll('#jobs tbody tr').length")
        if rows != 1:
            raise CheckFailed(f"jobs?state=failed: {rows} rows, want 1")

        # Paging: a page after a job holds only older jobs and links back to the newest.
        browser.goto(f"{base}/ui/jobs?after={bad}")
        expect(f"jobs?after={bad}", browser, f"j{ok}", f"before j{bad}", "« newest")
        shown = browser.eval("[...document.querySelectorAll('#jobs tbody tr td:first-child')]"
                             ".map(td => td.textContent)")
        if shown != [f"j{ok}"]:
            raise CheckFailed(f"jobs?after={bad}: rows {shown}, want only j{ok}")

        browser.goto(f"{base}/ui/jobs/{long}")
        expect(f"job j{long}", browser, f"Job j{long}", "running", "Attempts", "local",
               "step 1 of 3000", "following")
        # The attempt's epoch is exact (a u64 past what a JS number keeps): the node's own.
        local_epoch = next(n["epoch"] for n in api.call("GET", "/v1/nodes")[1]["nodes"]
                           if n["node"] == "local")
        shown = browser.eval("document.querySelector('#attempts tbody td:nth-child(3)')"
                             ".textContent")
        if shown != local_epoch:
            raise CheckFailed(f"job j{long}: attempt epoch {shown}, node local has {local_epoch}")
        # The log follows by cursor: later lines arrive without a reload.
        expect(f"job j{long} (followed)", browser, "step 30 of 3000")
        if a.shots:
            browser.shoot(os.path.join(a.shots, "ui-job.png"))

        # A reader late to a burst: the log shows how many bytes the buffer lost (E15).
        browser.goto(f"{base}/ui/jobs/{burst}")
        expect(f"job j{burst}", browser, "bytes lost (evicted)", "burst line 5000")
        lost = browser.eval("document.querySelector('#log .gap').textContent")
        print(f"  gap marker: {lost}")

        browser.goto(f"{base}/ui/jobs/{bad}")
        expect(f"job j{bad}", browser, "failed", "Exit code", "3 tests failed",
               "end of log", "final")
        browser.goto(f"{base}/ui/jobs/{waiting}")
        expect(f"job j{waiting}", browser, "queued", "waiting", "gpu")

        browser.goto(base + "/ui/nodes")
        expect("nodes", browser, "local", "ready", "builder-2", "grace", "s left",
               "linux, x86_64", " / 4", "/ —")
        if a.shots:
            browser.shoot(os.path.join(a.shots, "ui-nodes.png"))
        # The lift button (its fetch carries X-Millrace-UI): the node connects again.
        expect("nodes (quarantined)", browser, "flaky-3", "quarantined", "Lift quarantine")
        browser.eval("window.confirm = () => true;"
                     "[...document.querySelectorAll('#nodes button')]"
                     ".find(b => b.textContent === 'Lift quarantine').click()")
        wait_for("flaky-3 ready after the lift", lambda: any(
            n["node"] == "flaky-3" and n["state"] == "ready"
            for n in api.call("GET", "/v1/nodes")[1]["nodes"]))
        expect("nodes (lifted)", browser, "flaky-3")
        wait_for("the nodes page to show flaky-3 ready", lambda: browser.eval(
            "[...document.querySelectorAll('#nodes tbody tr')].some(r => "
            "r.cells[0].textContent === 'flaky-3' && r.cells[1].textContent === 'ready')"))
        print("  ok nodes: lift quarantine → flaky-3 ready")

        # Cancel from the job page (the button's fetch carries X-Millrace-UI).
        browser.goto(f"{base}/ui/jobs/{long}")
        expect(f"job j{long} before cancel", browser, "Cancel")
        browser.eval("window.confirm = () => true; document.getElementById('cancel').click()")
        wait_for(f"j{long} cancelled", lambda: api.job(long)["state"] == "cancelled")
        expect(f"job j{long} after cancel", browser, "cancelled", "end of log")

        # Logout ends the session: the pages go back to the login form.
        browser.eval("document.getElementById('logout').click()")
        wait_for("the login form after logout",
                 lambda: browser.eval("location.pathname") == "/ui/login")
        status = browser.eval("fetch('/v1/jobs').then(r => r.status)")
        if status != 401:
            raise CheckFailed(f"after logout /v1/jobs answered {status}, want 401")
        print("ui check: ok")
        return 0
    except CheckFailed as e:
        print(f"ui check FAILED: {e}", file=sys.stderr)
        log_path = os.path.join(tmp, "standalone.log")
        if os.path.exists(log_path):
            print(open(log_path).read()[-4000:], file=sys.stderr)
        return 1
    finally:
        if browser:
            browser.close()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
