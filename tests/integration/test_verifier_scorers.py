"""Scorers beyond math through the real verifier: gRPC on loopback, real worker processes, a real HTTP scorer.

One call routes items by data_source to math-verify, the countdown Python scorer and an HTTP scorer; failing
Python scorers are ERROR/TIMEOUT and the workers go on; the HTTP scorer retries what may clear up and nothing else.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from rlep.common.config import ServerConfig
from rlep.common.types import Verdict
from rlep.services.verifier.client import ScoredItem, VerifierClient
from rlep.services.verifier.config import HttpScorer, VerifierConfig
from rlep.services.verifier.http_scorer import RemoteScorer
from rlep.services.verifier.main import start_verifier
from tests.metrics_util import samples, scrape

pytestmark = pytest.mark.integration

TOKEN = "scorer-token"
COUNTDOWN = json.dumps({"target": 24, "numbers": [8, 3, 2, 1]})
UNIT = "tests.unit.test_verifier_scorers"


def sleeps(response: str, ground_truth: str, extra: dict) -> float:
    """Blocks without using CPU: only the pool's wall-clock kill ends it."""
    time.sleep(3600)
    return 0.0


class ScoringServer(ThreadingHTTPServer):
    """Scores `len(response) / 10` at /score; other paths misbehave. Counts requests by path."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: dict[str, int] = {}
        self.release = threading.Event()  # /slow answers once set
        self.bodies: list = []  # every request's parsed body

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: ScoringServer

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        item = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.bodies.append(item)
        count = self.server.requests[self.path] = self.server.requests.get(self.path, 0) + 1
        if self.headers.get("authorization") != f"Bearer {TOKEN}":
            return self._reply(401, b"{}")
        if self.path == "/flaky" and count == 1:
            return self._reply(503, b"busy")
        if self.path == "/down":
            return self._reply(500, b"")
        if self.path == "/bad-request":
            return self._reply(422, b"{}")
        if self.path == "/nan":
            return self._reply(200, b'{"score": NaN}')
        if self.path == "/big":
            return self._reply(200, b'{"score": 1, "extracted_answer": "' + b"x" * 100_000 + b'"}')
        if self.path == "/slow":
            self.server.release.wait(60)
        if isinstance(item, list):  # a batch: one answer per item, in order; /short drops the last, /one-bad breaks one
            answers = [len(one["response"]) / 10 for one in item]
            if self.path == "/short":
                answers.pop()
            body = json.dumps(answers).encode()
            return self._reply(200, body.replace(b"0.2", b'"high"') if self.path == "/one-bad" else body)
        score = len(item["response"]) / 10 * item["extra"].get("weight", 1)
        self._reply(200, json.dumps({"score": score, "extracted_answer": item["data_source"]}).encode())


@pytest.fixture(scope="module")
def scoring_server():
    server = ScoringServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("scorer") / "token"
    path.write_text(TOKEN + "\n")
    return path


def remote(server: ScoringServer, path: str, token_file, **fields) -> RemoteScorer:
    spec = HttpScorer(url=server.url + path, auth_token_file=token_file, backoff_s=0.01, **fields)
    return RemoteScorer(spec, "rm", max_answer_chars=512)


@pytest.fixture(scope="module")
def verifier(scoring_server, token_file):
    scorers = {
        "countdown": {"type": "python", "function": "rlep.services.verifier.countdown:score"},
        "broken": {"type": "python", "function": f"{UNIT}:raises"},
        "nan": {"type": "python", "function": f"{UNIT}:returns_nan"},
        "hangs": {"type": "python", "function": f"{__name__}:sleeps"},
        "rm": {
            "type": "http",
            "url": scoring_server.url + "/score",
            "auth_token_file": token_file,
            "success_threshold": 0.5,
        },
    }
    config = VerifierConfig(
        server=ServerConfig(port=0, metrics_port=0),
        num_workers=2,
        item_timeout_s=2.0,
        parse_timeout_s=0.5,
        scorers=scorers,
    )
    running = start_verifier(config)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(verifier):
    with VerifierClient(f"127.0.0.1:{verifier.port}") as client:
        yield client


def test_one_call_routes_items_by_data_source(client):
    items = [
        ("\\boxed{\\frac12}", "0.5"),  # a plain pair: the default scorer, math
        ScoredItem("<answer>(8 * 3) * (2 - 1)</answer>", COUNTDOWN, "countdown"),
        ScoredItem("so \\boxed{3}", "3", "DAPO-17k"),  # an unlisted label: the default scorer, math
        ScoredItem("<answer>8 + 3 + 2 + 1</answer>", COUNTDOWN, "countdown"),
        ScoredItem("\\boxed{7}", "3", ""),
        ScoredItem("<answer>24</answer>", COUNTDOWN, "countdown"),  # math-verify would call this right
        ScoredItem("abcdef", "gold", "rm", extra='{"weight": 0.5}'),  # remote: 6 / 10 * 0.5 = 0.3
        ScoredItem("abcdefghij", "gold", "rm"),  # remote: 1.0
    ]
    outcomes = client.verify(items)
    assert [o.verdict for o in outcomes] == [
        Verdict.CORRECT,
        Verdict.CORRECT,
        Verdict.CORRECT,
        Verdict.WRONG,
        Verdict.WRONG,
        Verdict.WRONG,
        Verdict.WRONG,
        Verdict.CORRECT,
    ]
    assert [o.reward for o in outcomes] == [1.0, 1.0, 1.0, 0.1, -1.0, 0.1, 0.3, 1.0]  # math keeps +1/-1
    assert [o.score for o in outcomes] == [1.0, 1.0, 1.0, 0.1, 0.0, 0.1, 0.3, 1.0]
    assert outcomes[1].extracted_answer == "(8 * 3) * (2 - 1)" and outcomes[6].extracted_answer == "rm"


def test_failing_python_scorers_are_errors_and_the_workers_go_on(client, verifier, caplog):
    """Issue 47: each failure is also said, with its reason, in the verifier's log (the first few per scorer, then
    a line a minute), and counted under its scorer's label: ERROR and reward 0 with nothing logged before."""
    caplog.set_level(logging.WARNING, logger="rlep.services.verifier.routing")
    pids = verifier.pool.worker_pids
    items = [
        ScoredItem("x", "y", "broken"),
        ScoredItem("x", "y", "nan"),
        ScoredItem("x", "y", "hangs"),  # killed at item_timeout_s, worker replaced
        ScoredItem("<answer>8*3*(2-1)</answer>", COUNTDOWN, "countdown"),
        ("\\boxed{2}", "2"),
    ]
    outcomes = client.verify(items)
    assert [o.verdict for o in outcomes] == [
        Verdict.ERROR,
        Verdict.ERROR,
        Verdict.TIMEOUT,
        Verdict.CORRECT,
        Verdict.CORRECT,
    ]
    assert [o.reward for o in outcomes[:3]] == [0.0, 0.0, 0.0]  # error_reward
    said = [r.getMessage() for r in caplog.records]
    assert "scorer broken: item ERROR: RuntimeError: scorer bug" in said
    assert "scorer nan: item ERROR: ValueError: score must be finite, not nan" in said
    assert "scorer hangs: item TIMEOUT: over item_timeout_s (2 s): worker killed" in said
    assert not [line for line in said if line.startswith(("scorer countdown", "scorer default"))]
    counted = {
        (s.labels["scorer"], s.labels["verdict"]): s.value
        for s in samples(scrape(verifier.metrics_port))
        if s.name == "rlep_verifier_items_total" and s.value
    }
    assert {("broken", "error"), ("nan", "error"), ("hangs", "timeout"), ("countdown", "correct")} <= set(counted)
    assert ("default", "correct") in counted  # the plain pair: the default scorer's label
    assert len(set(verifier.pool.worker_pids) - set(pids)) == 1
    assert [o.verdict for o in client.verify([ScoredItem("<answer>8*3*2/2</answer>", COUNTDOWN, "countdown")])] == [
        Verdict.WRONG
    ]


def test_an_extra_that_is_not_a_json_object_is_invalid_argument(client):
    with pytest.raises(grpc.RpcError) as err:
        client.verify([("\\boxed{1}", "1"), ScoredItem("x", "y", "countdown", extra="[1, 2]")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "item 1" in err.value.details()


def test_http_scorer_retries_a_5xx_then_scores(scoring_server, token_file):
    result = remote(scoring_server, "/flaky", token_file, success_threshold=0.5).score("abcdefgh", "g", "")
    assert (result.verdict, result.score, scoring_server.requests["/flaky"]) == (Verdict.CORRECT, 0.8, 2)


def test_http_scorer_gives_up_after_its_retries(scoring_server, token_file):
    result = remote(scoring_server, "/down", token_file, retries=2).score("a", "g", "")
    assert (result.verdict, result.score, scoring_server.requests["/down"]) == (Verdict.ERROR, None, 3)


def test_http_scorer_does_not_retry_auth_failures_or_other_4xx(scoring_server, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    assert remote(scoring_server, "/auth", wrong, retries=3).score("a", "g", "").verdict == Verdict.ERROR
    assert remote(scoring_server, "/auth", None, retries=3).score("a", "g", "").verdict == Verdict.ERROR
    assert scoring_server.requests["/auth"] == 2
    assert remote(scoring_server, "/bad-request", wrong, retries=3).score("a", "g", "").verdict == Verdict.ERROR
    assert scoring_server.requests["/bad-request"] == 1


@pytest.mark.parametrize("path", ["/nan", "/big"])
def test_http_scorer_refuses_nan_and_oversized_answers(scoring_server, token_file, path):
    result = remote(scoring_server, path, token_file, max_response_bytes=4096).score("a", "g", "")
    assert (result.verdict, result.score, scoring_server.requests[path]) == (Verdict.ERROR, None, 1)


def test_http_scorer_attempts_are_bounded_in_time(scoring_server, token_file):
    result = remote(scoring_server, "/slow", token_file, timeout_s=0.3, retries=1).score("a", "g", "")
    assert (result.verdict, scoring_server.requests["/slow"]) == (Verdict.TIMEOUT, 2)


def test_http_scorer_sends_batches_of_batch_size_and_keeps_their_order(scoring_server, token_file):
    spec = HttpScorer(url=scoring_server.url + "/batch", auth_token_file=token_file, batch_size=2)
    config = VerifierConfig(server=ServerConfig(port=0), num_workers=1, scorers={"rm": spec})
    running = start_verifier(config)
    try:
        with VerifierClient(f"127.0.0.1:{running.port}") as client:
            outcomes = client.verify([ScoredItem("a" * n, "g", "rm") for n in range(1, 6)])
    finally:
        running.stop()
    assert [o.score for o in outcomes] == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert scoring_server.requests["/batch"] == 3
    batches = [b for b in scoring_server.bodies if isinstance(b, list)]
    assert sorted(len(b) for b in batches) == [1, 2, 2]
    assert {one["data_source"] for b in batches for one in b} == {"rm"}


def test_a_bad_entry_fails_its_item_and_a_short_answer_fails_the_batch(scoring_server, token_file):
    one_bad = remote(scoring_server, "/one-bad", token_file, batch_size=3).score_many([("a", "g", ""), ("ab", "g", "")])
    assert [(r.verdict, r.score) for r in one_bad] == [(Verdict.WRONG, 0.1), (Verdict.ERROR, None)]
    short = remote(scoring_server, "/short", token_file, batch_size=3, retries=2).score_many([("a", "g", "")] * 3)
    assert [r.verdict for r in short] == [Verdict.ERROR] * 3
    assert scoring_server.requests["/short"] == 1  # a wrong answer is not retried
