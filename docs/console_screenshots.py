"""The README's pictures of the web console, from a real learning run (issue 31).

    .venv/bin/python docs/console_screenshots.py                    # runs `make run`'s demo first
    .venv/bin/python docs/console_screenshots.py --log-dir runs/rl-demo-seed0   # a finished one

With no `--log-dir` it runs the demo (`python -m tinker_local.apps.demo --log-dir
runs/screenshots-rl-demo`: 60 RL steps on SmolLM2-135M-Instruct, 8-25 min on a 2-core CPU), so
the reward and evaluation accuracy rise (0.1 to about 0.8, 9.5 % to about 75 %) and the
transcripts are real answers. Then it starts a tinker-local server in this process (the
embedded one `make run` uses: no API keys, loopback only), registers the run's log directory,
opens its console page and the overview in headless Chromium (the system's `chromium`, as the
browser tests use, `tests/server/console_browser.py`) and writes

    docs/images/console-rl-demo-run.png   the run's page: reward with its ± 1 s.e. band,
                                          accuracy with its interval, loss, KL, transcripts
    docs/images/console-rl-demo-overview.png

The browser tests' own screenshots (the tiny random model, a flat 0 reward) stay in their
temporary folders unless `TINKER_LOCAL_SCREENSHOTS=1`; the README shows these instead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "docs" / "images"
VIEWPORT = {"width": 1280, "height": 900}


def _rewards(log_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines() if x]
    return [r["reward/mean"] for r in rows if "reward/mean" in r]


def _check_it_learned(log_dir: Path) -> None:
    """The point of these pictures is a curve that rises: refuse a run that did not learn."""
    rewards = _rewards(log_dir)
    if len(rewards) < 10:
        raise SystemExit(f"{log_dir}: {len(rewards)} steps logged; a finished demo has 60")
    tenth = max(1, len(rewards) // 10)
    first, last = sum(rewards[:tenth]) / tenth, sum(rewards[-tenth:]) / tenth
    if last < first + 0.2:
        raise SystemExit(
            f"{log_dir}: mean reward {first:.2f} at the start and {last:.2f} at the end; "
            "the README's pictures should show a run that learned"
        )
    print(f"{log_dir}: mean reward {first:.2f} -> {last:.2f} over {len(rewards)} steps")


def _shoot(log_dir: Path, out: Path) -> list[Path]:
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(REPO / "tests" / "server"))
    from console_browser import chromium_binary

    from tinker_local.apps.connect import register_log_dir

    run_url = register_log_dir(log_dir, "rl")
    if run_url is None:
        raise SystemExit("the embedded server did not register the log directory")
    root = run_url.split("/logs/", 1)[0] + "/"
    written = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_binary(), headless=True, args=["--no-proxy-server"]
        )
        page = browser.new_context(viewport=VIEWPORT).new_page()
        page.goto(run_url)
        page.wait_for_selector("#chart-reward svg polygon.band", state="attached", timeout=60_000)
        page.wait_for_selector("#chart-eval svg[data-points]", state="attached", timeout=60_000)
        if page.locator("details.transcript").count():
            page.click("details.transcript summary")  # the newest answers, open
        for name, url in (("run", None), ("overview", root)):
            if url is not None:
                page.goto(url)
                page.wait_for_selector("#logged-runs tr[data-log]", timeout=60_000)
            path = out / f"console-rl-demo-{name}.png"
            page.screenshot(path=str(path), full_page=True)
            written.append(path)
        browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="a finished demo run; default: run the demo first")
    parser.add_argument("--out", type=Path, default=IMAGES, help="default docs/images")
    args = parser.parse_args(argv)
    log_dir = args.log_dir
    if log_dir is None:
        log_dir = REPO / "runs" / "screenshots-rl-demo"
        subprocess.run(
            [sys.executable, "-m", "tinker_local.apps.demo", "--log-dir", str(log_dir)],
            check=True,
        )
    log_dir = log_dir.resolve()
    _check_it_learned(log_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in _shoot(log_dir, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
