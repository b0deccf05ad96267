"""`brisk bench dashboard`: the live dashboard in a real headless browser while a load runs, saved
as a screenshot (BENCHMARKS.md shows it).

A `brisk serve` of the engine flags, loaded by the load generator at `--request-rate` on a
thread of this process, and Debian's Chromium (driven by selenium through chromium-driver;
`make install` installs both) on GET /dashboard. `--seconds` into the load, while it still
runs, the page is photographed; the figures it showed are printed beside the load
generator's own once the load is done.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time

from brisk.args import config_flags, engine_config_from_args
from brisk.bench.harness import brisk_serve, free_port, machine
from brisk.bench.load import LoadReport, LoadSettings, mtbench_requests, run_load, with_repeats
from brisk.config import ConfigError, ServerConfig


def open_browser(width: int = 1400, height: int = 900):
    """A headless Chromium under selenium, its console log kept (for the page's errors)."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        raise ConfigError("the dashboard's browser needs Debian's chromium and chromium-driver (make install)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        raise ConfigError("the dashboard's browser needs selenium: pip install -e '.[test]'") from exc
    options = Options()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(driver))


def main(args) -> None:
    browser = open_browser()
    server = ServerConfig(port=free_port(), log_level="warning")
    # The response cache on, as served by default, so its panel has figures: a third of the
    # requests repeat an earlier one. Its store is a new one, so no earlier run's answers are found.
    requests = with_repeats(mtbench_requests(args.num_prompts, args.output_len), 1 / 3)
    print(machine())
    try:
        with tempfile.TemporaryDirectory(prefix="brisk-dashboard-") as data_dir:
            flags = [*config_flags(engine_config_from_args(args)), *config_flags(server), "--data-dir", data_dir]
            with brisk_serve(flags, server, args.startup_timeout, response_cache=True) as url:
                browser.get(f"{url}/dashboard")
                result: list[LoadReport] = []
                load = threading.Thread(target=lambda: result.append(asyncio.run(run_load(
                    url, requests, LoadSettings(request_rate=args.request_rate), "dashboard load", progress=False))))
                load.start()
                time.sleep(args.seconds)  # the load still running: the page as its user would see it
                browser.save_screenshot(args.screenshot)
                shown = {name: browser.find_element("id", f"tile-{name}").text
                         for name in ("throughput", "running", "waiting", "kv", "prefix", "cache", "ttft")}
                errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
                load.join()
        print(f"load: {len(requests)} MT-Bench chat requests (a third repeating an earlier one, temperature 0), "
              f"{args.output_len} tokens, Poisson at {args.request_rate:g} req/s; screenshot after {args.seconds:g} s")
        print("\n".join(result[0].lines()))
        print("the page showed: " + "; ".join(f"{name} {value}" for name, value in shown.items()))
        print(f"page errors: {errors or 'none'}")
        print(f"wrote {args.screenshot}")
    finally:
        browser.quit()
