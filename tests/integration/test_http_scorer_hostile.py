"""A hostile HTTP scorer on loopback: answers that break the parser, bytes dripped past the timeout, credentials in
its URL. Each item still gets its own verdict within `timeout_s` per attempt, through the real verifier too, and no
log line names the URL's password.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from rlep.common.config import ServerConfig
from rlep.common.types import Verdict
from rlep.services.verifier.client import ScoredItem, VerifierClient
from rlep.services.verifier.config import HttpScorer, VerifierConfig
from rlep.services.verifier.http_scorer import RemoteScorer
from rlep.services.verifier.main import start_verifier

pytestmark = pytest.mark.integration

OVERFLOW = b"1" + b"0" * 400  # strict JSON, an int no float holds
DEEP = b"[" * 5_000 + b"]" * 5_000
DRIP_EVERY_S = 0.1  # well under the scorer's per-read timeout: only a bound on the whole attempt stops it


def _reply(body: bytes, length: bool = True) -> bytes:
    head = b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n"
    return head + (b"content-length: %d\r\n" % len(body) if length else b"") + b"\r\n" + body


# path -> (bytes sent at once, bytes then dripped one per DRIP_EVERY_S)
ANSWERS = {
    "/overflow": (_reply(OVERFLOW), b""),
    "/overflow-batch": (_reply(b"[0.5, " + OVERFLOW + b"]"), b""),
    "/deep": (_reply(DEEP), b""),
    "/ok": (_reply(b"1"), b""),
    "/drip-headers": (b"", _reply(b"1")),
    "/drip-body": (_reply(b"1.0" + b" " * 60)[:-61], b" " * 60),
    "/drip-until-close": (_reply(b"", length=False), b"1" * 60),  # cut short, "11" would read as a score
}


class HostileScorer:
    """A raw-socket HTTP/1.0 server: reads one request, answers per `ANSWERS`, records each request's head."""

    def __init__(self):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.heads: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            request = conn.recv(65_536)
            if request.startswith(b"\x16"):  # a TLS ClientHello: answer a server hello, one byte at a time
                at_once, dripped = b"", b"\x16\x03\x03\x40\x00" + b"\x02" * 60
            else:
                while b"\r\n\r\n" not in request and (chunk := conn.recv(65_536)):
                    request += chunk
                head, _, body = request.partition(b"\r\n\r\n")
                length = int(next(v for k, v in _headers(head) if k == b"content-length"))
                while len(body) < length and (chunk := conn.recv(65_536)):
                    body += chunk
                self.heads.append(head)
                at_once, dripped = ANSWERS[head.split()[1].decode()]
            try:
                conn.sendall(at_once)
                for byte in dripped:
                    time.sleep(DRIP_EVERY_S)
                    conn.sendall(bytes([byte]))
            except OSError:  # the scorer hung up: what a bounded client does
                pass

    def close(self) -> None:
        self._listener.close()


def _headers(head: bytes) -> Iterator[tuple[bytes, bytes]]:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        yield key.strip().lower(), value.strip()


@pytest.fixture(scope="module")
def hostile():
    server = HostileScorer()
    yield server
    server.close()


def scorer(url: str, **fields) -> RemoteScorer:
    return RemoteScorer(HttpScorer(url=url, backoff_s=0.01, **fields), "rm", max_answer_chars=512)


@pytest.mark.parametrize("path", ["/overflow", "/deep"])
def test_an_answer_that_breaks_the_parser_is_that_items_error(hostile, path):
    result = scorer(hostile.url + path, retries=0).score("a", "g", "")
    assert (result.verdict, result.score) == (Verdict.ERROR, None)


def test_an_overflowing_entry_fails_its_item_only(hostile):
    results = scorer(hostile.url + "/overflow-batch", batch_size=2).score_many([("a", "g", ""), ("b", "g", "")])
    assert [(r.verdict, r.score) for r in results] == [(Verdict.WRONG, 0.5), (Verdict.ERROR, None)]


@pytest.mark.parametrize("path", ["/drip-headers", "/drip-body", "/drip-until-close", "tls-handshake"])
def test_timeout_bounds_the_whole_exchange_of_an_attempt(hostile, path):
    """Every byte comes within the per-read timeout; the answer takes 6 s; each attempt is cut at 0.5 s."""
    url = hostile.url.replace("http:", "https:") + "/" if path == "tls-handshake" else hostile.url + path
    started = time.monotonic()
    result = scorer(url, timeout_s=0.5, retries=1).score("a", "g", "")
    elapsed = time.monotonic() - started
    assert (result.verdict, result.score) == (Verdict.TIMEOUT, None)
    assert elapsed < 2.5, elapsed  # 2 attempts of 0.5 s, the backoff and some slack for a loaded machine


def test_the_urls_password_is_sent_as_basic_auth_and_never_logged(hostile, caplog):
    port = hostile.url.rsplit(":", 1)[1]
    with caplog.at_level(logging.WARNING, logger="rlep.services.verifier.http_scorer"):
        assert scorer(f"http://rm:s3cret-pw@127.0.0.1:{port}/ok").score("a", "g", "").verdict == Verdict.CORRECT
        failed = scorer(f"http://rm:s3cret-pw@127.0.0.1:{port}/deep", retries=0).score("a", "g", "")
    assert failed.verdict == Verdict.ERROR
    assert b"authorization: Basic cm06czNjcmV0LXB3" in hostile.heads[-2]  # base64 of rm:s3cret-pw
    assert "rm:***@127.0.0.1" in caplog.text
    assert "s3cret" not in caplog.text


@pytest.fixture(scope="module")
def verifier(hostile):
    scorers = {
        route: {"type": "http", "url": hostile.url + path, "retries": 0, "batch_size": size}
        for route, path, size in [("overflow", "/overflow", 1), ("deep", "/deep", 1), ("batch", "/overflow-batch", 2)]
    }
    running = start_verifier(VerifierConfig(server=ServerConfig(port=0), num_workers=1, scorers=scorers))
    with VerifierClient(f"127.0.0.1:{running.port}", timeout_s=10) as client:
        yield client
    running.stop()


def test_bad_answers_end_the_verify_call_with_their_items_errors(verifier):
    """The call came back only at its deadline: the scorer's exception left the batch's positions unset."""
    items = [ScoredItem("a", "g", "overflow"), ScoredItem("b", "g", "deep"), ("\\boxed{2}", "2")]
    items += [ScoredItem("c", "g", "batch"), ScoredItem("d", "g", "batch")]
    outcomes = verifier.verify(items)
    verdicts = [o.verdict for o in outcomes]
    assert verdicts == [Verdict.ERROR, Verdict.ERROR, Verdict.CORRECT, Verdict.WRONG, Verdict.ERROR]


def test_an_extra_nested_past_the_bound_is_invalid_argument(verifier):
    extra = '{"a": ' * 3_000 + "1" + "}" * 3_000
    with pytest.raises(grpc.RpcError) as err:
        verifier.verify([ScoredItem("a", "g", "overflow", extra=extra)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nest 3000 deep" in err.value.details()
