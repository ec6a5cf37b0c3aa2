"""``poolkeeper lab``: serve (or write) the queue lab page, one self-contained HTML file.

The page runs :class:`poolkeeper.lab.QueueLab`'s model in JavaScript. Its constants (step length,
reset backlog, starting rates) and the pattern a typed rate must match are generated here from
``poolkeeper.lab``, so the page and the Python model share one definition.
"""
from __future__ import annotations

import argparse
import html
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from poolkeeper import lab
from poolkeeper.report._inline import asset, fill, inline_code, script_json


def page_config() -> dict:
    """The numbers and the rate pattern the page's model uses, taken from ``poolkeeper.lab``."""
    return {
        "step_seconds": lab.STEP_SECONDS,
        "reset_backlog": lab.RESET_BACKLOG,
        "arrival_rate": lab.DEFAULT_ARRIVAL_RATE,
        "service_rate": lab.DEFAULT_SERVICE_RATE,
        "rate_pattern": lab.RATE_PATTERN,
    }


def render_html() -> str:
    """The queue lab page: HTML with its CSS, JavaScript and configuration inline."""
    return fill(
        asset("queue_lab.html"),
        {
            "CSS": inline_code(asset("queue_lab.css"), "</style"),
            "JS": inline_code(asset("queue_lab.js"), "</script"),
            "CONFIG": script_json(page_config()),
            "STEP_SECONDS": html.escape(f"{lab.STEP_SECONDS:g}"),
            "RESET_BACKLOG": html.escape(f"{lab.RESET_BACKLOG:g}"),
        },
    )


class _Handler(BaseHTTPRequestHandler):
    page: bytes = b""
    quiet: bool = True
    timeout = 30  # seconds; a browser's idle speculative connection must not hold a thread forever

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        # The same status and headers as GET, no body (link checkers and monitors ask this way).
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        if self.path.split("?", 1)[0] not in ("/", "/index.html"):
            self.send_error(404, "the queue lab lives at /")  # http.server omits the body for HEAD
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(self.page)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(self.page)

    def log_message(self, format: str, *args) -> None:  # noqa: A002
        if not self.quiet:
            super().log_message(format, *args)


def make_server(port: int = 0, quiet: bool = True) -> ThreadingHTTPServer:
    """An HTTP server for the page on 127.0.0.1 (``port=0``: a free port; see ``server_port``).

    Call ``serve_forever()`` (e.g. on a thread) and ``shutdown()``/``server_close()`` when done.
    """
    handler = type("QueueLabHandler", (_Handler,), {"page": render_html().encode("utf-8"), "quiet": quiet})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    return server


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer is "forever", which is the default anyway


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--write", metavar="PATH", help="write the page to PATH and exit instead of serving it")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--once", action="store_true", help="stop after serving one request")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help="stop serving after SECONDS")
    parser.add_argument("--open", action="store_true", help="open the page in the default web browser")
    parser.add_argument("--verbose", action="store_true", help="log each request")


def run(args: argparse.Namespace) -> int:
    if args.write:
        from poolkeeper._paths import write_output

        write_output(args.write, render_html(), "--write")  # whole or not at all
        print(f"wrote {args.write}")
        return 0
    if not 0 <= args.port <= 65535:
        print(f"poolkeeper lab: --port must be 0..65535, not {args.port}", file=sys.stderr)
        return 2
    if args.timeout is not None and not (0 < args.timeout <= MAX_TIMEOUT_S):
        # inf overflows threading.Timer / select; nan and <= 0 mean nothing sensible.
        print(f"poolkeeper lab: --timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], not {args.timeout!r}",
              file=sys.stderr)
        return 2
    try:
        server = make_server(args.port, quiet=not args.verbose)
    except OSError as e:
        print(f"poolkeeper lab: cannot listen on 127.0.0.1:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    url = f"http://127.0.0.1:{server.server_port}/"
    stop_hint = "" if args.once or args.timeout else " (Ctrl+C to stop)"
    print(f"queue lab at {url}{stop_hint}", flush=True)
    if args.open:
        import webbrowser

        webbrowser.open(url)
    try:
        if args.once:
            server.timeout = args.timeout
            server.daemon_threads = False  # so server_close() waits until the page is sent
            server.handle_request()
        else:
            timer: Optional[threading.Timer] = None
            if args.timeout:
                # shutdown() must come from another thread than serve_forever's.
                timer = threading.Timer(args.timeout, server.shutdown)
                timer.daemon = True
                timer.start()
            server.serve_forever(poll_interval=0.2)
            if timer:
                timer.cancel()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
