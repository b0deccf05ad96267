"""The response cache over HTTP: hit latency with 10,000 entries, false hits and paraphrase hits.

Per store (SQLite, then Redis on a redis-server this benchmark starts), a real `brisk serve`
of the default model with its response cache on:

1. Filling: 10,000 distinct chat questions ("How do I {verb} my {thing} in the {product} app?",
   a product name in each so none is a question of the sets below), embedded here and written
   into the server's store by this process while the server runs (a second writer, as a second
   server process would be), under the keys the server computes for them (its model identity
   from /v1/model/info, the same request fields). All share one namespace, so every semantic
   lookup below searches all of them. (Filling over HTTP runs the model 10,000 times: some 13
   requests/s here, over ten minutes per store.) One request then checks that a filler is an
   exact hit over HTTP.
2. The look-alike and paraphrase sets (brisk/bench/data/): each pair's first question is asked (a
   miss, stored), then its second: a hit on a look-alike is a false hit, a hit on a paraphrase
   is what the semantic cache is for. The header X-Brisk-Cache says which.
3. Hit latency, one request at a time, client-side end to end (request sent to body read, over
   one kept-alive connection of the standard library's http.client, the leanest client at
   hand): every question of both sets again, each an exact hit (it was stored) or a semantic
   one (it was answered from another's entry, which stores nothing), as the response header
   says. Beside them, the same client's `GET /health`: the floor any route has on this machine.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from http.client import HTTPConnection
from typing import Iterator

import httpx

from brisk.bench.harness import brisk_serve, free_port, machine
from brisk.bench.workloads import read_jsonl
from brisk.engine.stats import percentiles
from brisk.cache.response_cache import ResponseCache
from brisk.cache.store import open_store
from brisk.config import ServerConfig
from brisk.embed.embedder import Embedder
from brisk.server.caching import cache_query, model_scope
from brisk.server.middleware import DEFAULT_TENANT
from brisk.server.openai_api import chat_cacheable
from brisk.server.protocol import ChatCompletionRequest

DATA = os.path.join(os.path.dirname(__file__), "data")
VERBS = ["reset", "update", "export", "share", "archive", "restore", "rename", "verify", "sync", "back up",
         "print", "copy", "move", "schedule", "translate", "download", "upload", "lock", "recover", "review"]
THINGS = ["password", "profile", "invoice", "calendar", "contacts", "photos", "playlist", "notes", "budget", "files",
          "settings", "messages", "reports", "tasks", "receipts", "documents", "bookmarks", "templates", "orders",
          "subscriptions", "reminders", "recipes", "workouts", "projects", "passwords"]
PRODUCTS = ["Zorblo", "Quenta", "Pivvo", "Larkspur", "Mendel", "Tavira", "Ostrel", "Brimble", "Kestra", "Vollo",
            "Nimbra", "Corvid", "Ylang", "Fennic", "Drossel", "Ulmo", "Sarnac", "Wexley", "Halcyo", "Trindle"]


# The look-alike and paraphrase sets were written before the guard (guard.py) and tuned against;
# the held-out ones were written after it was frozen, and measure it as a new user's questions would.
# The surface look-alikes differ only where the embedder is blind (case, accents, emoji, symbols,
# code, quoted text: cosine 1.0 for most) and were written with the guard's verbatim check.
SETS = ("lookalike", "paraphrase", "heldout_lookalike", "heldout_paraphrase", "surface_lookalike")
LOOKALIKES = tuple(n for n in SETS if "lookalike" in n)
PARAPHRASES = tuple(n for n in SETS if "paraphrase" in n)


def filler_questions(count: int) -> list[str]:
    combos = itertools.product(PRODUCTS, VERBS, THINGS)
    return [f"How do I {verb} my {thing} in the {product} app?" for product, verb, thing in
            itertools.islice(combos, count)]


def pairs(name: str) -> list[dict]:
    return read_jsonl(os.path.join(DATA, f"{name}_pairs.jsonl"))


class RedisServer:
    """A throwaway redis-server (Debian's, from `make install`) on a free port, keeping no data
    (no persistence). kill() and start() again keep its port, as a Redis restarted by its
    supervisor does: what the store's fault tests need."""

    def __init__(self, folder: str):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed (make install puts Debian's package in)")
        self.folder, self.port = folder, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> None:
        import redis

        self.process = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                                         self.folder, "--save", "", "--appendonly", "no"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client, deadline = redis.Redis(port=self.port), time.monotonic() + timeout
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    code = self.process.poll()
                    if code is not None or time.monotonic() > deadline:
                        self.kill()
                        raise RuntimeError(f"redis-server did not start (exit code {code})") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)


@contextmanager
def redis_server(folder: str) -> Iterator[str]:
    """A RedisServer for the length of a `with`; yields its URL."""
    server = RedisServer(folder)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def _chat(question: str) -> dict:
    return {"model": "bench", "messages": [{"role": "user", "content": question}], "max_tokens": 1, "temperature": 0}


def _fill(url: str, base_url: str, questions: list[str], embedder: Embedder) -> float:
    """Writes an answer for every question into the store at `url`, keyed as the server at
    `base_url` keys them; returns the seconds it took."""
    start = time.perf_counter()
    scope = model_scope("bench", httpx.get(f"{base_url}/v1/model/info").json()["identity"])
    cache = ResponseCache(open_store(url, 1_000_000, embedder.dimensions), 86400.0)
    for first in range(0, len(questions), 256):
        chunk = questions[first:first + 256]
        for question, vector in zip(chunk, embedder.encode(embedder.tokenize(chunk)).numpy()):
            query = cache_query(scope, DEFAULT_TENANT, chat_cacheable(ChatCompletionRequest(**_chat(question))), 0.95,
                                embedder.identity)
            cache.save(query, vector, {"object": "chat.completion", "model": "bench", "usage": {},
                                       "choices": [{"index": 0, "finish_reason": "length", "logprobs": None,
                                                    "message": {"role": "assistant", "content": question}}]})
    cache.close()
    return time.perf_counter() - start


def _ask(http: http.client.HTTPConnection, question: str) -> tuple[str, float]:
    """(X-Brisk-Cache, seconds from sending to the whole body read)."""
    start = time.perf_counter()
    http.request("POST", "/v1/chat/completions", body=json.dumps(_chat(question)),
                 headers={"Content-Type": "application/json"})
    response = http.getresponse()
    body = response.read()
    seconds = time.perf_counter() - start
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {body[:500]!r}")
    return response.headers["x-brisk-cache"], seconds


def _health(http: http.client.HTTPConnection) -> float:
    start = time.perf_counter()
    http.request("GET", "/health")
    http.getresponse().read()
    return time.perf_counter() - start


def run_store(name: str, url: str, flags: list[str], entries: int, rounds: int, startup_timeout: float,
              embedder: Embedder) -> dict:
    server = ServerConfig(port=free_port(), served_model_name=["bench"])
    flags = [*flags, "--port", str(server.port), "--served-model-name", "bench", "--dtype", "float32",
             "--kv-cache-memory-gib", "1"]
    sets = {name: pairs(name) for name in SETS}
    lookalike = [p for n in LOOKALIKES for p in sets[n]]
    paraphrase = [p for n in PARAPHRASES for p in sets[n]]
    with brisk_serve(flags, server, startup_timeout, response_cache=True) as base_url:
        http = HTTPConnection("127.0.0.1", server.port, timeout=120)
        fillers = filler_questions(entries - len(lookalike) - len(paraphrase))
        fill_seconds = _fill(url, base_url, fillers, embedder)
        if _ask(http, fillers[-1])[0] != "exact":
            raise RuntimeError("a filler written into the store is not an exact hit over HTTP: the keys differ")
        outcome = {}
        for set_name, data in sets.items():
            for p in data:  # most paraphrase pairs reword a look-alike question, which may be cached already
                _ask(http, p["a"])
            outcome[set_name] = [_ask(http, p["b"])[0] for p in data]
        stats = httpx.get(f"{base_url}/v1/cache/stats").json()["response_cache"]
        latencies = {"exact": [], "semantic": [], "miss": []}
        for _ in range(rounds):
            for question in [p[side] for p in lookalike + paraphrase for side in ("a", "b")]:
                status, seconds = _ask(http, question)
                latencies[status].append(seconds)
        if latencies["miss"]:
            raise RuntimeError(f"{len(latencies['miss'])} questions asked before were misses")
        floor = [_health(http) for _ in range(len(latencies["exact"]))]
        http.close()
        exact, semantic = latencies["exact"], latencies["semantic"]
    return {"store": name, "entries": stats["entries"], "bytes": stats["bytes"], "fill_seconds": fill_seconds,
            "exact": exact, "semantic": semantic, "server": stats["hit_latency_ms"], "floor": floor,
            "false_hits": {n: [p for p, s in zip(sets[n], outcome[n]) if s != "miss"] for n in LOOKALIKES},
            "paraphrase_hits": {n: sum(s == "semantic" for s in outcome[n]) for n in PARAPHRASES},
            "sizes": {n: len(sets[n]) for n in sets}, "guard_rejections": stats["guard_rejections"]}


def main(args) -> None:
    print(machine())
    print(f"workload: {args.entries} cached chat answers in one namespace, then the look-alike and paraphrase sets "
          f"(brisk/bench/data/); hit latency over HTTP, one request at a time, {args.rounds} rounds; threshold 0.95")
    results = []
    embedder = Embedder(backend=args.embedding_backend)  # the server's: its vectors, its namespace
    flags = ["--embedding-backend", args.embedding_backend]
    with tempfile.TemporaryDirectory() as folder:
        for store in args.stores:
            if store == "sqlite":
                url = f"sqlite://{folder}/response_cache.sqlite3"
                results.append(run_store("SQLite", url, [*flags, "--cache-url", url], args.entries, args.rounds,
                                         args.startup_timeout, embedder))
            else:
                with redis_server(folder) as url:
                    results.append(run_store("Redis 7.0", url, [*flags, "--cache-url", url], args.entries,
                                             args.rounds, args.startup_timeout, embedder))
    print(f"\nembedding backend of the server: {args.embedding_backend}; latencies client-side (server-side: the "
          f"lookup alone, embedding included)")
    print("\n| store | entries | MB | GET /health p50 / p99 (ms) | exact hit p50 / p99 (ms) | server-side "
          "| semantic hit p50 / p99 (ms) | server-side | false hits: look-alikes, held out, surface "
          "| paraphrase hits, held out | guard refusals |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        server = {kind: f"{v['p50']:.1f} / {v['p99']:.1f}" if v["count"] else "-" for kind, v in r["server"].items()}
        false_hits = ", ".join(f"{len(r['false_hits'][n])} of {r['sizes'][n]}"
                               for n in LOOKALIKES)
        paraphrases = ", ".join(f"{r['paraphrase_hits'][n]} of {r['sizes'][n]} "
                                f"({r['paraphrase_hits'][n] / r['sizes'][n]:.0%})" for n in PARAPHRASES)
        print(f"| {r['store']} | {r['entries']} | {r['bytes'] / 1e6:.1f} | {_ms(r['floor'])} | {_ms(r['exact'])} "
              f"| {server['exact']} "
              f"| {_ms(r['semantic'])} | {server['semantic']} | {false_hits} | {paraphrases} "
              f"| {r['guard_rejections']} |")
    for r in results:
        for p in [p for hits in r["false_hits"].values() for p in hits]:
            print(f"false hit ({r['store']}): {p['a']!r} answered {p['b']!r}")


def _ms(seconds: list[float]) -> str:
    if not seconds:
        return "-"
    p50, p99 = percentiles(seconds, (0.5, 0.99))
    return f"{p50 * 1000:.1f} / {p99 * 1000:.1f} (n={len(seconds)})"
