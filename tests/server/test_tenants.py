"""Tenants on a real `brisk serve` (a process, the tiny model): fair shares of the batch, per
tenant limits answered with 429, priorities. Bounds are asserted in engine steps (which of the
other streams, each hundreds of steps long, had ended meanwhile), never in wall time."""

from __future__ import annotations

import itertools
import json
import threading
import time

import httpx
import pytest

from tests.conftest import build_tiny_checkpoint
from tests.helpers import metric_values
from tests.server.conftest import serve_tiny

FLOOD, FLOOD_TOKENS, SEATS = 8, 400, 4
# beta's streams: long enough that its second still finds its first running (both then hold seats
# taken from alpha), however the host delays the second's arrival
BETA_TOKENS = 64
KEYS = "ka alpha\nkb beta max_concurrent=3 max_queued_tokens=100000\n"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), "llama")


@pytest.fixture()
def server(tiny_folder, tmp_path):
    """Starts `brisk serve` with the keys file and these flags; stops it after the test."""
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    processes = []

    def start(*flags: str) -> str:
        process, url = serve_tiny(tiny_folder, "--api-keys-file", str(keys), "--max-num-seqs", str(SEATS),
                                  "--max-model-len", "512", "--num-kv-blocks", "512", "--no-response-cache",
                                  "--embedding-model", "none", *flags)
        processes.append(process)
        return url

    yield start
    for process in processes:
        process.terminate()
        process.wait(timeout=60)


class Tape:
    """Every streamed token of every request, in the order the client saw them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, str]] = []  # (request name, "sent" | "token")

    def mark(self, name: str, what: str) -> None:
        with self.lock:
            self.events.append((name, what))

    def stream(self, url: str, key: str, name: str, max_tokens: int, **fields) -> threading.Thread:
        def run():
            body = {"prompt": "w3 w4 w5", "max_tokens": max_tokens, "ignore_eos": True, "stream": True, **fields}
            self.mark(name, "sent")
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300,
                              headers={"Authorization": f"Bearer {key}"}) as r:
                if r.status_code != 200:
                    self.mark(name, f"status {r.status_code}")
                    return
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line.removeprefix("data: "))["choices"][0]
                        self.mark(name, "token" if choice["finish_reason"] is None else choice["finish_reason"])

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    def count(self, name: str) -> int:
        with self.lock:
            return sum(1 for n, what in self.events if n == name and what == "token")

    def finished(self, name: str) -> str | None:
        """How the request ended: its finish_reason, or the HTTP status it got."""
        with self.lock:
            return next((what for n, what in reversed(self.events) if n == name and what not in ("sent", "token")),
                        None)


def _flood_then_two(url: str) -> Tape:
    """alpha floods (FLOOD streams of FLOOD_TOKENS, twice the seats); once its streams run, beta
    sends two shorter ones."""
    tape = Tape()
    flood = [tape.stream(url, "ka", f"alpha{i}", FLOOD_TOKENS) for i in range(FLOOD)]
    _until(lambda: sum(tape.count(f"alpha{i}") for i in range(FLOOD)) >= 3 * SEATS, "the batch full and decoding")
    beta = [tape.stream(url, "kb", f"beta{i}", BETA_TOKENS) for i in range(2)]
    for thread in itertools.chain(beta, flood):
        thread.join(timeout=600)
    return tape


def _alpha_done_before_beta(tape: Tape) -> int:
    """How many of alpha's streams had ended when beta's first token came: each one is
    FLOOD_TOKENS engine steps. (The client's own clock is no measure: on a loaded host the
    server may take many steps just to read beta's request.)"""
    first_beta = tape.events.index(next(e for e in tape.events if e[0].startswith("beta") and e[1] == "token"))
    return sum(1 for name, what in tape.events[:first_beta] if name.startswith("alpha") and what == "length")


def test_a_flooding_tenant_queues_behind_its_own_requests(server):
    """fair (the default with a keys file): beta's requests take two of alpha's seats as soon as
    they reach the engine, so beta's first token comes while alpha's first streams still run
    (FLOOD_TOKENS steps each). Under fcfs beta waits for the whole first wave (test below)."""
    url = server()
    tape = _flood_then_two(url)
    assert _alpha_done_before_beta(tape) == 0
    assert all(tape.finished(f"alpha{i}") == "length" for i in range(FLOOD))  # the preempted ones too
    assert all(tape.finished(f"beta{i}") == "length" for i in range(2))
    # beta's seats were taken from alpha; every request is counted under its tenant, and the
    # tenants' counts add up to the totals
    metrics = metric_values(httpx.get(f"{url}/metrics", timeout=60).text)
    assert metrics["brisk:num_preemptions_total"] >= 2
    tenant = {t: {name: metrics.get(f'brisk:tenant_{name}_total{{tenant="{t}"}}')
                  for name in ("requests", "prompt_tokens", "generation_tokens")} for t in ("alpha", "beta")}
    assert tenant["alpha"]["requests"] == FLOOD and tenant["beta"]["requests"] == 2
    assert tenant["alpha"]["generation_tokens"] == FLOOD * FLOOD_TOKENS
    assert tenant["beta"]["generation_tokens"] == 2 * BETA_TOKENS
    for name in ("prompt_tokens", "generation_tokens"):
        assert sum(tenant[t][name] for t in tenant) == metrics[f"brisk:{name}_total"]


def test_fcfs_makes_the_same_tenant_wait_out_the_flood(server):
    url = server("--scheduling-policy", "fcfs")
    assert _alpha_done_before_beta(_flood_then_two(url)) >= SEATS  # the first wave, FLOOD_TOKENS steps
    assert metric_values(httpx.get(f"{url}/metrics", timeout=60).text)["brisk:num_preemptions_total"] == 0


def test_a_tenant_past_its_limit_gets_429_with_retry_after(server):
    url = server()
    tape = Tape()
    held = [tape.stream(url, "kb", f"beta{i}", 120) for i in range(3)]
    _until(lambda: sum(tape.count(f"beta{i}") for i in range(3)) >= 3, "beta's streams to run")
    body = {"prompt": "w3", "max_tokens": 2}
    refused = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer kb"}, timeout=60)
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and "max_concurrent" in error["message"]
    other = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer ka"}, timeout=60)
    assert other.status_code == 200  # another tenant's limit is its own
    for thread in held:
        thread.join(timeout=600)
    assert {tape.finished(f"beta{i}") for i in range(3)} == {"length"}
    again = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer kb"}, timeout=60)
    assert again.status_code == 200  # the finished streams gave their seats back


def test_priorities_reorder_the_queue(server):
    """--scheduling-policy priority, one seat: behind a running request, the waiting request
    with the lower priority value runs first, whatever the order they came in."""
    # a first request long enough (3,000 steps) that both others queue behind it on a loaded host
    url = server("--scheduling-policy", "priority", "--max-num-seqs", "1", "--max-model-len", "4096",
                 "--num-kv-blocks", "2048")
    tape = Tape()
    first = tape.stream(url, "ka", "running", 3000)
    _until(lambda: tape.count("running"), "the first request to run")
    later = tape.stream(url, "ka", "later", 32, priority=5)
    _wait_for_waiting(url, 1)  # queued behind the running one before the next arrives
    sooner = tape.stream(url, "ka", "sooner", 32, priority=1)
    _wait_for_waiting(url, 2)
    assert tape.count("running") < 3000  # both queued while the first still ran
    for thread in (first, later, sooner):
        thread.join(timeout=600)
    # The tape is the client's view: three threads reading three streams may record a token a few
    # engine steps late. One seat: sooner's 32 tokens all come before later's first.
    order = [name for name, what in tape.events if what == "token"]
    assert order.index("sooner") < order.index("later")
    # neither took the running request's seat (its priority, 0, is better): it ran to the end first
    # (a preempted one would have hundreds of its 3,000 tokens left; a late reader, a few: 5 seen
    # on a loaded host, so the bound is one request's worth, far from a preemption's)
    assert order[order.index("sooner"):].count("running") <= 32
    assert {tape.finished(n) for n in ("running", "later", "sooner")} == {"length"}


def _wait_for_waiting(url: str, n: int) -> None:
    _until(lambda: metric_values(httpx.get(f"{url}/metrics", timeout=60).text).get("brisk:num_requests_waiting", 0)
           >= n, f"{n} requests waiting")


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 300  # a safety net against a hang, not a speed check
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.01)


def test_a_full_queue_refuses_the_flooding_tenant_not_the_other(server):
    """The waiting queue holds 4: alpha's flood fills it, and alpha's next request is refused;
    beta, with nothing in flight, is within its share of the server and is served."""
    url = server("--max-waiting-seqs", "4")
    tape = Tape()
    flood = [tape.stream(url, "ka", f"alpha{i}", FLOOD_TOKENS) for i in range(SEATS)]
    _until(lambda: sum(tape.count(f"alpha{i}") for i in range(SEATS)) >= SEATS, "alpha seated, not waiting")
    flood += [tape.stream(url, "ka", f"alpha{i}", FLOOD_TOKENS) for i in range(SEATS, SEATS + 4)]
    _wait_for_waiting(url, 4)
    body = {"prompt": "w3", "max_tokens": 2}
    refused = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer ka"}, timeout=60)
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    served = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer kb"}, timeout=300)
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2
    for thread in flood:
        thread.join(timeout=600)
    assert {tape.finished(f"alpha{i}") for i in range(SEATS + 4)} == {"length"}
