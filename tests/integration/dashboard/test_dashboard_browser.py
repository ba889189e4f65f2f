"""The dashboard in a real browser (Debian's Chromium, driven by Playwright) while a real
training run goes on: the run's reward curve and step move without a reload (live, by
server-sent events), the rollouts' filters and search work, a rollout's span tree opens and
its LLM call reads as a chat with token counts. The screenshots it takes go to
$AGL_STREAM_SCREENSHOTS (`make screenshots` writes docs/dashboard/), else to a temporary folder.

Without Chromium the test skips with the reason, unless AGL_STREAM_REQUIRE_BROWSER is set
(CI sets it: `make browser` installs Chromium there)."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from agl_stream.demo.task import tasks
from agl_stream.embedded.process import free_port
from agl_stream.launch.run import RunConfig, StepPoint, run_training
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings

pytestmark = [pytest.mark.slow, pytest.mark.browser]

# Chromium as root in a sandboxless machine, with no network beyond loopback: no sandbox,
# and none of its background connections (they are refused, many at a time).
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
    "--disable-background-networking", "--disable-component-update",
]  # fmt: skip
WAIT_MS = 120_000  # waits on conditions; a slow machine only makes them longer


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        reason = "no Chromium on this machine (`make browser` installs Debian's, as root)"
        if os.environ.get("AGL_STREAM_REQUIRE_BROWSER"):
            pytest.fail(f"AGL_STREAM_REQUIRE_BROWSER is set but there is {reason}")
        pytest.skip(reason)
    return found


@pytest.fixture
async def page(tmp_path: Path) -> AsyncIterator[object]:
    playwright_api = pytest.importorskip("playwright.async_api")
    executable = chromium()
    async with playwright_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            context = await browser.new_context(viewport={"width": 1280, "height": 860})
            yield await context.new_page()
        finally:
            await browser.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    where = Path(os.environ.get("AGL_STREAM_SCREENSHOTS") or tmp_path / "screenshots")
    where.mkdir(parents=True, exist_ok=True)
    return where


async def _up(url: str, training: asyncio.Task[list[StepPoint]]) -> None:
    """Wait until the demo's dashboard answers (or the demo has stopped)."""
    async with aiohttp.ClientSession() as http:
        while not training.done():
            try:
                async with http.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    training.result()  # raises what stopped it
    raise AssertionError("the demo ended before its dashboard answered")


@pytest.mark.timeout(900)  # a training run of six steps and a tour of the pages
async def test_watch_the_demo_live(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path, page: object, shots: Path
) -> None:
    """The dashboard the demo runs (as `make demo` does). The demo waits after its second
    step while the test tours the pages, and after its last step until the page shows it:
    the page, loaded at step 2, must get to step 6 by itself."""
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    port = free_port()
    config = RunConfig(
        steps=6,
        runners=1,
        out_dir=tmp_path,
        run_name="watched-run",
        dashboard_port=port,
        task_source=tasks,
    )
    toured, seen_last = threading.Event(), threading.Event()

    def on_step(point: StepPoint) -> None:
        if point.step == 2:
            toured.wait(WAIT_MS / 1000)
        if point.step == config.steps:
            seen_last.wait(WAIT_MS / 1000)

    demo = asyncio.to_thread(run_training, config, kafka, database, on_step)
    training = asyncio.create_task(demo)
    try:
        url = f"http://127.0.0.1:{port}/"
        await _up(url, training)
        await page.goto(url)
        await expect(page.locator("#live")).to_have_text("● live", timeout=WAIT_MS)
        await page.evaluate("window.loadedOnce = true")  # gone if the page ever reloads
        step = page.locator('[data-run="watched-run"] .latest-step')
        try:
            await expect(step).to_have_text("2", timeout=WAIT_MS)
        except AssertionError:
            raise AssertionError(
                f"the page never showed step 2 (demo done: {training.done()}); it shows: "
                f"{await page.inner_text('body')}"
            ) from None

        # Rollouts: filters, pages, a search by id.
        await page.click('nav a[data-view="rollouts"]')
        rows = page.locator("tr[data-rollout]")
        await expect(rows.first).to_be_visible(timeout=WAIT_MS)
        await page.select_option('select[name="status"]', ["failed"])
        await page.click('form.filters button[type="submit"]')
        await expect(page.locator(".empty")).to_have_text("No rollout matches.", timeout=WAIT_MS)
        await page.select_option('select[name="status"]', ["succeeded"])
        await page.select_option('select[name="mode"]', "train")
        # A live update between the choice and the click (the read model changes all the
        # time) re-renders the form: it must keep what was chosen but not yet applied.
        await page.evaluate("async () => { document.activeElement.blur(); await render(true); }")
        await page.click('form.filters button[type="submit"]')
        await expect(rows).to_have_count(50, timeout=WAIT_MS)  # a page of them
        await page.screenshot(path=shots / "rollouts.png")
        first = await rows.first.get_attribute("data-rollout")
        await page.click("button.next")
        # Until the next page is rendered the first one shows, 50 rows too: a search typed
        # into its form would be replaced by the next page's empty form.
        await expect(rows.first).not_to_have_attribute("data-rollout", first or "", timeout=WAIT_MS)
        await expect(rows).to_have_count(50, timeout=WAIT_MS)  # two steps: 128 rollouts
        wanted = await rows.nth(3).get_attribute("data-rollout")
        assert wanted is not None
        await page.fill('input[name="id"]', wanted)
        await page.click('form.filters button[type="submit"]')
        await expect(rows).to_have_count(1, timeout=WAIT_MS)

        # A rollout: its attempt, the span tree, the LLM call as a chat.
        await rows.first.click()
        await expect(page.locator("h2")).to_have_text(f"Rollout {wanted}", timeout=WAIT_MS)
        call = page.locator('.span[data-span="agl.llm.call"]').first
        await expect(call).to_be_visible(timeout=WAIT_MS)
        assert await page.locator(".waterfall .span").count() >= 3
        await call.click()
        chat = page.locator(".span-detail .chat")
        await expect(chat).to_be_visible()
        await expect(chat).to_contain_text("prompt tokens")
        await expect(chat).to_contain_text("mean logprob")
        await page.screenshot(path=shots / "rollout.png", full_page=True)

        for view, marker in [("workers", "tr[data-worker]"), ("resources", "tbody tr")]:
            await page.click(f'nav a[data-view="{view}"]')
            await expect(page.locator(marker).first).to_be_visible(timeout=WAIT_MS)
        await page.screenshot(path=shots / "resources.png")

        # Back to the runs: the demo goes on, and the page follows it with no reload.
        await page.click('nav a[data-view="runs"]')
        await expect(step).to_have_text("2", timeout=WAIT_MS)
        toured.set()
        await expect(step).to_have_text(str(config.steps), timeout=WAIT_MS)
        assert await page.evaluate("window.loadedOnce") is True
        await page.screenshot(path=shots / "runs.png")
        seen_last.set()
        points = await training
        assert [p.step for p in points] == list(range(1, config.steps + 1))
    finally:
        toured.set()
        seen_last.set()
        await asyncio.gather(training, return_exceptions=True)
