"""The replay page in a real headless Chromium: the served viewer and the static report (file://).

Clicks through to a step and checks what it shows; model output carrying script payloads is shown
as text and runs nothing. Needs Debian's chromium and the playwright package
(scripts/install_browser.sh); skipped without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from experiments.report import write_report
from experiments.store import RunStore, episode_id
from experiments.viewer import serve
from experiments.viewer.data import step_prompt
from tests.support.browser import Page
from tests.support.runfactory import PAYLOAD, game_id, make_run, standard_tasks

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "run", standard_tasks())


def expected_prompt(run: Path, game: str, trial: int, step: int) -> str:
    store = RunStore(run, readonly=True)
    try:
        row = store.episode(episode_id(game, trial))
        assert row is not None
        return step_prompt(store, row, store.steps(row.episode_id), step).shown
    finally:
        store.close()


def click_through(p: Page, url: str, run: Path) -> None:
    page = p.page
    page.goto(url)
    page.wait_for_selector("#app[data-ready='1']")
    assert page.locator("[data-testid=task-row]").count() == 4

    # Filters: by task type, by outcome.
    page.select_option("[data-testid=filter-type]", "cool")
    assert page.locator("[data-testid=task-row]").count() == 1
    page.select_option("[data-testid=filter-type]", "")
    page.select_option("[data-testid=filter-outcome]", "unsolved")
    rows = page.locator("[data-testid=task-row]")
    assert rows.count() == 1 and rows.first.get_attribute("data-game") == game_id("cool", 4)
    page.select_option("[data-testid=filter-outcome]", "")

    # A failed episode, step by step.
    clean = game_id("clean", 2)
    row = page.locator(f"[data-testid=task-row][data-game='{clean}']")
    row.locator("[data-testid=cell][data-trial='0']").click()
    page.wait_for_selector("[data-testid=episode]")
    assert page.locator("[data-testid=outcome]").text_content() == "✗ failed"
    assert page.locator("[data-testid=verdict]").text_content() == "repeated_action"
    steps = page.locator("[data-testid=step]")
    assert steps.count() == 5
    assert "kind-invalid" in steps.nth(2).get_attribute("class")
    assert "inadmissible" in steps.nth(3).get_attribute("class")
    assert steps.nth(3).locator(".kind").text_content() == "inadmissible"

    # The thought with the payloads: shown as literal text, nothing ran.
    steps.nth(0).click()
    detail = page.locator("[data-testid=step-detail]")
    raw = detail.locator("[data-testid=raw-output]")
    assert raw.is_visible() and raw.text_content() == f" think: {PAYLOAD}"
    assert steps.nth(0).locator(".action").text_content() == PAYLOAD
    assert page.get_by_text(PAYLOAD, exact=False).first.is_visible()
    assert detail.locator("[data-testid=detail-kind]").text_content() == "thought"

    # Another step, and its exact prompt on demand.
    steps.nth(3).click()
    detail = page.locator("[data-testid=step-detail]")
    assert detail.count() == 1
    assert detail.locator("[data-testid=detail-action]").text_content() == (
        "take banana 9 from countertop 1"
    )
    assert detail.locator("[data-testid=detail-observation]").text_content() == "Nothing happens."
    detail.locator("[data-testid=show-prompt]").click()
    prompt = detail.locator("[data-testid=prompt]:not(.hidden)")
    prompt.wait_for()
    assert prompt.text_content() == expected_prompt(run, clean, 0, 3)
    assert page.locator("[data-testid=reflection-after]").text_content().endswith(PAYLOAD)

    # Trial 1 side by side with trial 0, with the reflections in trial 1's prompt.
    page.locator("[data-testid=back]").click()
    page.wait_for_selector("[data-testid=task-table]")
    row = page.locator(f"[data-testid=task-row][data-game='{clean}']")
    row.locator("[data-testid=compare-link]").first.click()
    page.wait_for_selector("[data-testid=compare]")
    assert page.locator("[data-testid=compare-trial-0] [data-testid=outcome]").text_content() == (
        "✗ failed"
    )
    later = page.locator("[data-testid=compare-trial-1]")
    assert later.locator("[data-testid=outcome]").text_content() == "✓ won"
    memory = later.locator("[data-testid=memory] li")
    assert memory.count() == 1 and PAYLOAD in memory.first.text_content()
    assert memory.first.is_visible()

    # Deep link straight to a step of the won trial.
    page.goto(
        url + "#/episode/0/" + episode_id(clean, 1).replace("/", "%2F").replace("#", "%23") + "/4"
    )
    page.wait_for_selector("[data-testid=step-detail]")
    assert page.locator("[data-testid=detail-observation]").text_content() == (
        "You move the apple 1 to the fridge 1."
    )
    # the executed command is not what the model wrote: the step is marked as mapped
    mapped = page.locator("[data-testid=step] [data-testid=mapped]")
    assert mapped.count() == 1
    assert mapped.get_attribute("title") == "the model wrote: move the apple to the fridge"
    assert page.locator("[data-testid=detail-mapped]").is_visible()

    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.locator("img[src=x]").count() == 0
    assert p.errors == []


def test_served_viewer(browser: Any, run_dir: Path) -> None:
    with serve(run_dir) as srv:
        assert srv.url.startswith("http://127.0.0.1:")
        p = Page(browser)
        click_through(p, srv.url, run_dir)
        p.page.close()


def test_static_report_from_the_file_system(browser: Any, run_dir: Path, tmp_path: Path) -> None:
    out = write_report([run_dir], tmp_path / "report")
    p = Page(browser)
    url = (out / "index.html").resolve().as_uri()
    click_through(p, url, run_dir)
    page = p.page
    page.goto(url)
    page.wait_for_selector("#app[data-ready='1']")
    for name in ("learning_curve", "failures"):
        img = page.locator(f"[data-testid=plot-{name}]")
        assert img.evaluate("i => i.complete && i.naturalWidth") == 800
    assert page.locator("[data-testid=type-table] tbody tr").count() == 4
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert p.errors == []
    page.close()


def test_served_viewer_follows_a_run_being_written(browser: Any, tmp_path: Path) -> None:
    from memory.records import Step
    from tests.support.runfactory import task

    run = make_run(
        tmp_path / "live", [task("cool", 7, "running")], trials=1, wall_s=None, complete=False
    )
    eid = episode_id(game_id("cool", 7), 0)
    writer = RunStore(run)
    try:
        with serve(run) as srv:
            p = Page(browser)
            page = p.page
            page.goto(srv.url + "#/episode/0/" + eid.replace("/", "%2F").replace("#", "%23"))
            page.wait_for_selector("[data-testid=episode]")
            assert page.locator("[data-testid=step]").count() == 4
            assert page.locator("[data-testid=outcome]").text_content() == "… running"
            writer.add_step(
                eid,
                Step(index=4, kind="act", raw_output="move apple 1 to fridge 1",
                     action="move apple 1 to fridge 1", observation="You win.", won=True),
            )  # fmt: skip
            writer.finish_episode(eid, status="done", won=True)
            page.wait_for_selector("[data-testid=step][data-index='4']")  # no reload: it polls
            page.wait_for_function(
                "document.querySelector('[data-testid=outcome]').textContent === '✓ won'"
            )
            assert p.errors == []
            page.close()
    finally:
        writer.close()


def test_static_report_of_two_runs_filters_by_arm(
    browser: Any, run_dir: Path, tmp_path: Path
) -> None:
    from tests.support.runfactory import baseline_tasks

    react = make_run(tmp_path / "react", baseline_tasks(), arm="react")
    out = write_report([run_dir, react], tmp_path / "cmp")
    p = Page(browser)
    page = p.page
    page.goto((out / "index.html").resolve().as_uri())
    page.wait_for_selector("#app[data-ready='1']")
    assert page.locator("[data-testid=comparison-table] tbody tr").count() == 2
    assert page.locator("[data-testid=task-row]").count() == 8
    page.select_option("[data-testid=filter-arm]", "react")
    assert page.locator("[data-testid=task-row]").count() == 4
    page.select_option("[data-testid=filter-outcome]", "solved")
    assert page.locator("[data-testid=task-row]").count() == 2
    assert p.errors == []
    page.close()
