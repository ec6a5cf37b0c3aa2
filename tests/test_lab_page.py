"""``poolkeeper lab`` without a browser: the page's generated constants, --write, and the server."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from poolkeeper import lab
from poolkeeper.cli import main
from poolkeeper.report import lab_page


def config_of(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="lab-config">(.*?)</script>', html, re.S)
    assert m
    return json.loads(m.group(1))


def test_page_constants_come_from_the_python_model():
    cfg = config_of(lab_page.render_html())
    assert cfg == {
        "step_seconds": lab.STEP_SECONDS,
        "reset_backlog": lab.RESET_BACKLOG,
        "arrival_rate": lab.DEFAULT_ARRIVAL_RATE,
        "service_rate": lab.DEFAULT_SERVICE_RATE,
        "rate_pattern": lab.RATE_PATTERN,
    }


def test_page_follows_a_changed_model(monkeypatch):
    # Generated, not copied: change the model's constants and the page changes with them.
    monkeypatch.setattr(lab, "STEP_SECONDS", 0.25)
    monkeypatch.setattr(lab, "RESET_BACKLOG", 8.0)
    html = lab_page.render_html()
    cfg = config_of(html)
    assert (cfg["step_seconds"], cfg["reset_backlog"]) == (0.25, 8.0)
    assert "advances 0.25" in html


def test_page_is_self_contained_and_has_the_controls():
    html = lab_page.render_html()
    for id_ in ("arrival", "service", "reset", "step", "elapsed", "backlog", "error", "plot"):
        assert f'id="{id_}"' in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "fetch(" not in html and "@import" not in html


def test_page_is_an_analogy_only():
    # The lab is an analogy: the instrument contains no pointers, free lists, byte sizes or CUDA streams.
    # (Its text and script; the stylesheet's `cursor: pointer` is not part of the instrument.)
    text = re.sub(r"<style>.*?</style>", "", lab_page.render_html(), flags=re.S).lower()
    for word in ("pointer", "free list", "free_list", "cuda", "stream", "0x", "kib", "mib"):
        assert word not in text, word


def test_write(tmp_path, capsys):
    out = tmp_path / "lab.html"
    assert main(["lab", "--write", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == lab_page.render_html()
    assert f"wrote {out}" in capsys.readouterr().out


def test_served_page_and_404():
    server = lab_page.make_server(0)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        with urllib.request.urlopen(base + "/", timeout=10) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/html")
            assert r.read().decode("utf-8") == lab_page.render_html()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/etc/passwd", timeout=10)
        assert e.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_cli_serves_once_on_a_printed_free_port():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "poolkeeper.cli", "lab", "--once", "--timeout", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        m = re.match(r"queue lab at (http://127\.0\.0\.1:(\d+)/)", line)
        assert m, line + proc.stderr.read()
        with urllib.request.urlopen(m.group(1), timeout=10) as r:
            assert b'id="step"' in r.read()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_port_in_use_is_a_message(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["lab", "--port", str(port), "--once"]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err
