"""The live dashboard: LiveStats' arithmetic, /metrics.json, and the page in a real headless
Chromium (Debian's chromium and chromium-driver, which `make install` installs) while a load runs."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import httpx
import pytest

from brisk.bench.dashboard import open_browser
from brisk.bench.load import LoadRequest, LoadSettings, run_load
from brisk.engine.stats import EngineSnapshot, FinishedRequestStats, IterationStats, SpecDecodeStats
from brisk.server.live import WINDOW, LiveStats
from tests.helpers import require

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _snapshot(running: int, waiting: int, usage: float, queries: int = 0, hits: int = 0) -> EngineSnapshot:
    return EngineSnapshot(running, waiting, usage, 100, 50, 0, queries, hits, 0)


def test_live_stats_bucket_each_second_and_fill_idle_ones():
    clock = Clock(999.9)
    live = LiveStats(clock)
    live.record(_snapshot(1, 0, 0.1, queries=60, hits=0), IterationStats(num_sequences=1, num_prompt_tokens=60))
    clock.now = 1000.2
    live.record(_snapshot(3, 1, 0.25, queries=100, hits=40),
                IterationStats(num_sequences=4, num_prompt_tokens=50, num_generation_tokens=3,
                               time_to_first_tokens=[0.1, 0.3], inter_token_latencies=[0.02]))
    live.record(_snapshot(2, 0, 0.5, queries=100, hits=40),
                IterationStats(num_sequences=2, num_generation_tokens=2, inter_token_latencies=[0.04, 0.06],
                               finished=[FinishedRequestStats("stop", 1.0, 0.1, 10)],
                               spec=SpecDecodeStats(2, 8, 6, [2, 2, 1, 1])))
    clock.now = 1003.7  # three idle seconds later, the fourth under way
    snap = live.snapshot()
    s = snap["series"]
    assert len(s["t"]) == WINDOW and s["t"][-1] == -1 and s["t"][0] == -WINDOW  # whole seconds only
    at = s["t"].index(-3)  # second 1000
    assert s["output_tokens_per_s"][at] == 5 and s["prompt_tokens_per_s"][at] == 50
    assert s["prompt_tokens_per_s"][at - 1] == 60 and s["running"][at - 1] == 1
    assert s["requests_finished_per_s"][at] == 1 and s["mean_batch_size"][at] == 3.0
    # the gauges as the second's last step left them, carried over the idle seconds; none before
    assert s["running"][at:] == [2, 2, 2] and s["running"][at - 2] == 0
    assert s["kv_cache_usage"][-1] == 0.5 and s["output_tokens_per_s"][at + 1:] == [0, 0]
    # the prefix cache per second: second 1000 looked up 40 tokens and found all 40; idle ones none
    assert s["prefix_cache_hit_rate"][at] == 1.0 and s["prefix_cache_hit_rate"][at + 1] is None
    # speculative drafts: 6 of second 1000's 8 draft tokens accepted; none drafted in the others
    assert s["spec_acceptance_rate"][at] == 0.75 and s["spec_acceptance_rate"][at - 1] is None
    # TTFT over the trailing 10 s: both samples, until they age out
    assert s["ttft_p50_ms"][at] == pytest.approx(200) and s["ttft_p50_ms"][at - 1] is None
    assert snap["latency_ms"]["itl"]["count"] == 3 and snap["latency_ms"]["itl"]["p50"] == pytest.approx(40)
    assert snap["now"] == {"running": 2, "waiting": 0, "kv_cache_usage": 0.5, "prefix_cache_hit_rate": 0.4,
                           "spec_acceptance_rate": 0.75}
    clock.now = 1000.2 + WINDOW + 2  # the steps' seconds have left the window
    later = live.snapshot()
    assert sum(later["series"]["output_tokens_per_s"]) == 0 and later["latency_ms"]["ttft"]["count"] == 0
    assert later["series"]["running"] == [2] * WINDOW  # the gauges stand until a step changes them
    live.record(_snapshot(5, 0, 0.7), IterationStats(num_sequences=5))  # drops the old buckets
    clock.now += 1
    assert live.snapshot()["series"]["running"][-2:] == [2, 5]


def test_metrics_json_and_the_page_are_served_without_a_key(tiny_engine):
    from tests.server.conftest import running_server

    with running_server(tiny_engine, served_model_name="tiny", api_key="secret") as url:
        page = httpx.get(f"{url}/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "metrics.json" in page.text
        assert "http://" not in page.text and "https://" not in page.text  # it fetches nothing from elsewhere
        data = httpx.get(f"{url}/metrics.json").json()
        assert data["model"] == "tiny" and data["response_cache"] == {"enabled": False} and data["tenants"] == {}
        assert len(data["series"]["t"]) == WINDOW and set(data["now"]) == {
            "running", "waiting", "kv_cache_usage", "prefix_cache_hit_rate", "spec_acceptance_rate"}
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the rest still needs the key


def test_the_dashboard_moves_in_a_real_browser_while_a_load_runs(tiny_url, tmp_path):
    require(bool(CHROMIUM and CHROMEDRIVER), "chromium or chromedriver (Debian's chromium and chromium-driver, "
                                             "which make install installs)")
    driver = open_browser()
    try:
        driver.get(f"{tiny_url}/dashboard")
        _wait(lambda: driver.execute_script("return window.briskLatest !== null"), "the first poll")
        chart = "return document.getElementById('chart-throughput').toDataURL()"
        idle = driver.execute_script(chart)
        # At most 16 in flight: the server's waiting queue (32) never fills and answers 429, however slow the CPU.
        requests = [LoadRequest(f"w{5 + i % 20} w9", 48) for i in range(80)]
        reports = []
        load = threading.Thread(target=lambda: reports.append(asyncio.run(run_load(
            tiny_url, requests, LoadSettings(request_rate=20.0, max_concurrency=16), progress=False))))
        load.start()
        tokens = "return window.briskLatest.series.output_tokens_per_s.reduce((a, b) => a + b, 0)"
        _wait(lambda: driver.execute_script(tokens) > 0, "tokens on the page")
        assert float(driver.find_element("id", "tile-throughput").text) > 0  # drawn in the same poll
        _wait(lambda: driver.execute_script(chart) != idle, "the throughput chart to change")
        load.join(timeout=120)
        assert reports and reports[0].completed == 80, "the load did not complete"
        # the page counts every token of the load once the seconds it ran are whole
        _wait(lambda: driver.execute_script(tokens) == 80 * 48, "every token on the page")
        assert driver.find_element("id", "status").get_attribute("class") != "down"
        # the tenants' table: keyless requests are the default tenant's, all 80 of them
        rows = "return [...document.querySelectorAll('#tenants tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
        expected = [["default", "80", str(sum(r.prompt_tokens for r in reports[0].records)), str(80 * 48), "0"]]
        _wait(lambda: driver.execute_script(rows) == expected, f"the tenants' table to read {expected}")
        driver.save_screenshot(str(tmp_path / "dashboard.png"))
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
    finally:
        driver.quit()


def _wait(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
