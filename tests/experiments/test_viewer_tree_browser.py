"""The viewer shows a LATS episode's search tree and its chosen path, in a real headless
Chromium (served and static); model text in node labels is shown as text and runs nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from experiments.report import write_report
from experiments.store import RunStore, episode_id
from experiments.viewer import serve
from experiments.viewer.data import load_episode
from memory.records import SearchEnd, SearchIteration, SearchNode
from tests.support.runfactory import PAYLOAD, game_id, make_run, standard_tasks

pytestmark = pytest.mark.browser

EPISODE = episode_id(game_id("clean", 2), 1)


def node(i: int, parent: int | None, action: str, obs: str | None, **kw: Any) -> SearchNode:
    return SearchNode(
        node_id=i, parent_id=parent, depth=0 if parent is None else kw.pop("depth", 1),
        kind="" if parent is None else "act", raw_output=f" {action}", action=action,
        observation=obs, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The standard run, with a searched episode: a dead end whose action and reflection carry
    script payloads, a backtrack, and the chosen path to the win."""
    run = make_run(tmp_path_factory.mktemp("runs") / "run", standard_tasks(), arm="lats")
    store = RunStore(run)
    try:
        nodes = [
            node(0, None, "", "You are in the middle of a room.", visits=2, total=1.0),
            node(1, 0, f"go to {PAYLOAD}", "Nothing happens.", value=0.62, visits=1,
                 samples=5, terminal=True, reflection=f"That was a dead end {PAYLOAD}"),
            node(2, 0, "go to countertop 1", "You arrive at countertop 1.", value=0.38,
                 visits=1, total=1.0, samples=3),
            node(3, 2, "move apple 1 to fridge 1", "You move the apple 1 to the fridge 1.",
                 depth=2, value=1.0, visits=1, total=1.0, terminal=True, won=True),
            node(4, 0, "look", None, value=0.1),
        ]  # fmt: skip
        store.save_search(EPISODE, nodes[:2] + nodes[4:], SearchIteration(0, 0, 1, 0.0, 1))
        store.save_search(
            EPISODE, nodes, SearchIteration(1, 2, 3, 1.0, 2, replay_steps=0, resets=1,
                                            backtrack=True)
        )  # fmt: skip
        store.end_search(EPISODE, SearchEnd(3, True, "won"), [0, 2, 3])
    finally:
        store.close()
    return run


def test_episode_detail_carries_the_tree(run_dir: Path) -> None:
    from experiments.store import open_reader

    with open_reader(run_dir) as reader:
        detail = load_episode(reader, EPISODE)
        other = load_episode(reader, episode_id(game_id("put", 1), 0))
    assert detail is not None and other is not None and other["tree"] is None
    tree = detail["tree"]
    assert [n["chosen"] for n in tree["nodes"]] == [True, False, True, True, False]
    assert [n["backtrack"] for n in tree["nodes"]] == [False, False, True, False, False]
    assert tree["nodes"][4]["executed"] is False and tree["end"]["reason"] == "won"


def check_tree(page: Any, url: str) -> None:
    page.goto(url + "#/episode/0/" + EPISODE.replace("/", "%2F").replace("#", "%23"))
    page.wait_for_selector("[data-testid=tree]")
    labels = page.locator("[data-testid=tree-node]")
    assert labels.count() == 4  # the candidate never executed is counted, not drawn
    chosen = page.locator("[data-testid=tree-node][data-chosen='1']")
    assert [chosen.nth(i).get_attribute("data-node") for i in range(3)] == ["0", "2", "3"]
    root = page.locator("[data-testid=tree-node][data-node='0']")
    assert "1 candidate(s) never executed" in root.text_content()
    dead = page.locator("[data-testid=tree-node][data-node='1']")
    assert dead.locator(".node-action").text_content() == f"go to {PAYLOAD}"
    assert "value 0.62 · visits 1 · mean 0.00 · 5 samples" in dead.text_content()
    assert "✗ dead end" in dead.text_content()
    assert dead.locator("[data-testid=node-reflection]").text_content().endswith(PAYLOAD)
    back = page.locator("[data-testid=tree-node][data-node='2'] [data-testid=backtrack]")
    assert back.is_visible()
    assert "✓ won" in page.locator("[data-testid=tree-node][data-node='3']").text_content()
    summary = page.locator("[data-testid=tree-summary]").text_content()
    assert "5 nodes, 2 iteration(s), 1 backtrack(s)" in summary and "ended: won" in summary
    assert page.locator("[data-testid=iterations-table] tbody tr").count() == 2
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.locator("img[src=x]").count() == 0


def test_served_viewer_shows_the_tree(browser: Any, run_dir: Path) -> None:
    errors: list[str] = []
    with serve(run_dir) as srv:
        page = browser.new_page()
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        check_tree(page, srv.url)
        page.close()
    assert errors == []


def test_static_report_shows_the_tree_and_the_compute_plot(
    browser: Any, run_dir: Path, tmp_path: Path
) -> None:
    out = write_report([run_dir], tmp_path / "report")
    errors: list[str] = []
    page = browser.new_page()
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    url = (out / "index.html").resolve().as_uri()
    page.goto(url)
    page.wait_for_selector("#app[data-ready='1']")
    img = page.locator("[data-testid=plot-compute]")
    assert img.evaluate("i => i.complete && i.naturalWidth") == 800
    check_tree(page, url)
    page.close()
    assert errors == []
