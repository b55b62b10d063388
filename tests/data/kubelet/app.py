"""A tiny pod workload for the stand-in kubelet tests (standard library only).

An HTTP server on 0.0.0.0:$PORT (default 8080):
  GET  /healthz            200
  GET  /ready              200 while ready, else 503 (the readiness probe's target)
  POST /ready/{true|false} flip readiness; the answer tells when
  GET  /state              {"ready", "flipped_at", "first_unready_probe_at", "pid"}
  GET  /env                the environment
  GET  /file?path=P        a file's content
  GET  /whoami             calls the API server in-cluster style (service-account token and CA at
                           the standard path, KUBERNETES_SERVICE_HOST/PORT): GET its own pod, LIST secrets
  GET  /connect?host=H&port=P&timeout=T   a TCP connect from inside the pod
  GET  /pg?dsn=D           log in to PostgreSQL (asyncpg) and ask for current_user
  POST /crash?code=N       exit with status N
  GET|POST /event?name=N   print "event N" and record "N $ROLE" (an httpGet hook target)

On start it prints "started"; with ORDER_FILE it appends "start $ROLE" there. On SIGTERM it prints
"SIGTERM <time>" and appends "stop $ROLE" (and prints the ORDER_FILE) before exiting, unless
IGNORE_SIGTERM=1. With ALIVE_TICKS=1 it prints "alive <time>" every 100 ms.
"""

import json
import os
import signal
import socket
import ssl
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SA = "/var/run/secrets/kubernetes.io/serviceaccount"
STATE = {"ready": os.environ.get("READY_INITIAL", "true") == "true", "flipped_at": None,
         "first_unready_probe_at": None, "pid": os.getpid()}
ROLE = os.environ.get("ROLE", "app")


def say(*parts):
    print(*parts, flush=True)


def record(line):
    if path := os.environ.get("ORDER_FILE"):
        with open(path, "a") as out:
            out.write(line + "\n")


def api(path):
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    with open(f"{SA}/token") as f:
        token = f.read().strip()
    request = urllib.request.Request(f"https://{host}:{port}{path}", headers={"Authorization": f"Bearer {token}"})
    context = ssl.create_default_context(cafile=f"{SA}/ca.crt")
    try:
        with urllib.request.urlopen(request, context=context, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def whoami():
    with open(f"{SA}/namespace") as f:
        namespace = f.read().strip()
    name = os.environ.get("POD_NAME") or socket.gethostname()
    pod_status, pod = api(f"/api/v1/namespaces/{namespace}/pods/{name}")
    secrets_status, _ = api(f"/api/v1/namespaces/{namespace}/secrets")
    return {"namespace": namespace, "pod_status": pod_status, "pod_name": pod.get("metadata", {}).get("name"),
            "pod_uid": pod.get("metadata", {}).get("uid"), "secrets_status": secrets_status}


def connect(query):
    started = time.monotonic()
    try:
        with socket.create_connection((query["host"][0], int(query["port"][0])),
                                      timeout=float(query.get("timeout", ["1"])[0])):
            pass
    except OSError as exc:
        return {"ok": False, "error": repr(exc), "seconds": time.monotonic() - started}
    return {"ok": True, "error": "", "seconds": time.monotonic() - started}


def pg(dsn):
    import asyncio

    import asyncpg

    async def ask():
        conn = await asyncpg.connect(dsn, timeout=3)
        try:
            return await conn.fetchval("SELECT current_user")
        finally:
            await conn.close()

    try:
        return {"ok": True, "user": asyncio.run(ask())}
    except Exception as exc:
        return {"ok": False, "error": repr(exc)}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def event(self, name):
        say("event", name, time.time())
        record(f"{name} {ROLE}")
        self.reply(200, {"ok": True})

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path == "/healthz":
            self.reply(200, {"ok": True})
        elif url.path == "/ready":
            if not STATE["ready"] and STATE["first_unready_probe_at"] is None:
                STATE["first_unready_probe_at"] = time.time()
            self.reply(200 if STATE["ready"] else 503, {"ready": STATE["ready"]})
        elif url.path == "/state":
            self.reply(200, STATE)
        elif url.path == "/env":
            self.reply(200, dict(os.environ))
        elif url.path == "/file":
            with open(query["path"][0]) as f:
                self.reply(200, {"content": f.read()})
        elif url.path == "/whoami":
            self.reply(200, whoami())
        elif url.path == "/connect":
            self.reply(200, connect(query))
        elif url.path == "/pg":
            self.reply(200, pg(query["dsn"][0]))
        elif url.path == "/event":  # httpGet hooks use GET
            self.event(query["name"][0])
        else:
            self.reply(404, {"error": url.path})

    def do_POST(self):
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path.startswith("/ready/"):
            STATE["ready"] = url.path.endswith("/true")
            STATE["flipped_at"], STATE["first_unready_probe_at"] = time.time(), None
            self.reply(200, STATE)
        elif url.path == "/crash":
            self.reply(200, {"crashing": True})
            threading.Timer(0.05, os._exit, [int(query.get("code", ["3"])[0])]).start()
        elif url.path == "/event":
            self.event(query["name"][0])
        else:
            self.reply(404, {"error": url.path})


def on_sigterm(*_):
    say("SIGTERM", time.time())
    if os.environ.get("IGNORE_SIGTERM") == "1":
        return
    record(f"stop {ROLE}")
    if path := os.environ.get("ORDER_FILE"):
        with open(path) as f:
            say("order:", " | ".join(f.read().splitlines()))
    say("exiting")
    os._exit(0)


def tick():
    while True:
        say("alive", time.time())
        time.sleep(0.1)


def main():
    signal.signal(signal.SIGTERM, on_sigterm)
    server = ThreadingHTTPServer(("0.0.0.0", int(os.environ.get("PORT", "8080"))), Handler)
    if os.environ.get("ALIVE_TICKS") == "1":
        threading.Thread(target=tick, daemon=True).start()
    if path := os.environ.get("ORDER_FILE"):
        with open(path, "a+") as f:
            f.seek(0)
            say("order at start:", " | ".join(f.read().splitlines()))
    record(f"start {ROLE}")
    say("started", ROLE, os.getpid(), os.environ.get("POD_NAME", ""))
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
