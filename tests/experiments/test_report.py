"""Reports: summary.json against the run store, real PNGs of the right size, two-run comparison
with intervals and the paired test, and the committed results still render."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import struct
import zlib
from pathlib import Path

import pytest

from experiments.errors import RunStoreError
from experiments.report import PNG_SIZE, summarize_run, wilson_interval, write_report
from experiments.store import RunStore, open_reader
from memory.records import ModelCall
from tests.support.runfactory import (
    COMMITTED,
    COMMITTED_V1,
    REFLECTION_COMPLETION_TOKENS,
    REFLECTION_PROMPT_TOKENS,
    RESULTS,
    STEP_CACHED_TOKENS,
    STEP_COMPLETION_TOKENS,
    STEP_PROMPT_TOKENS,
    baseline_tasks,
    game_id,
    make_run,
    standard_tasks,
    task,
)

JUDGE_PROMPT_TOKENS = 70
JUDGE_COMPLETION_TOKENS = 3


def record_calls(run_dir: Path) -> Path:
    """Record the model calls that made a factory run, as the engine records them: one act call
    per step, one reflect call per reflection, one judge call per judged episode."""
    store = RunStore(run_dir)
    try:
        for e in store.episodes():
            for s in store.steps(e.episode_id):
                store.add_model_call(
                    ModelCall("act", e.game, e.trial, e.episode_id, s.prompt_tokens,
                              s.completion_tokens, s.cached_tokens, s.latency_s)
                )  # fmt: skip
            if e.judge_verdict is not None:
                store.add_model_call(
                    ModelCall("judge", e.game, e.trial, e.episode_id, JUDGE_PROMPT_TOKENS,
                              JUDGE_COMPLETION_TOKENS)
                )  # fmt: skip
        for r in store.reflections():
            store.add_model_call(
                ModelCall("reflect", r.task, r.trial, r.episode_id, REFLECTION_PROMPT_TOKENS,
                          REFLECTION_COMPLETION_TOKENS)
            )  # fmt: skip
    finally:
        store.close()
    return run_dir


@pytest.fixture(scope="module")
def reflexion_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_calls(make_run(tmp_path_factory.mktemp("runs") / "reflexion", standard_tasks()))


@pytest.fixture(scope="module")
def react_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = make_run(tmp_path_factory.mktemp("runs") / "react", baseline_tasks(), arm="react")
    return record_calls(run)


@pytest.fixture(scope="module")
def report_dir(reflexion_run: Path) -> Path:
    return write_report([reflexion_run])


def png_chunks(path: Path) -> list[tuple[bytes, bytes]]:
    """The chunks of a PNG file, with every CRC checked."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    chunks, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    return chunks


def png_size(path: Path) -> tuple[int, int]:
    chunks = png_chunks(path)
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height = struct.unpack(">II", chunks[0][1][:8])
    return width, height


def pixels(path: Path):
    import matplotlib.image

    return matplotlib.image.imread(str(path))


def color_pixels(img, hex_color: str, tol: float = 0.08) -> int:
    import numpy as np

    rgb = np.array([int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img[:, :, :3] - rgb).max(axis=2) < tol).sum())


def query(run_dir: Path, sql: str, *args: object) -> list[tuple]:
    conn = sqlite3.connect(f"file:{run_dir / 'run.sqlite'}?mode=ro", uri=True)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def test_summary_numbers_match_the_run_store(reflexion_run: Path, report_dir: Path) -> None:
    s = json.loads((report_dir / "summary.json").read_text())
    assert report_dir == reflexion_run / "report"
    assert (s["model"], s["arm"], s["evaluator"]) == ("scripted:learner", "reflexion", "paper")
    assert s["total_tasks"] == 4

    # The known outcomes: solved at trial 0, 1, 2 (after a harness error at trial 0), never.
    assert [
        (t["trial"], t["tasks_run"], t["newly_solved"], t["cumulative_solved"]) for t in s["trials"]
    ] == [
        (0, 4, 1, 1),
        (1, 3, 1, 2),
        (2, 2, 1, 3),
    ]
    assert s["by_task_type"] == {
        "put": {"total": 1, "solved": 1},
        "clean": {"total": 1, "solved": 1},
        "heat": {"total": 1, "solved": 1},
        "cool": {"total": 1, "solved": 0},
    }
    # The errored episode counts in errors, never as an agent failure.
    assert s["errors"] == 1 and "infra_error" not in s["failure_classes"]
    assert s["failure_classes"] == {
        "repeated_action": 2, "too_long": 1, "step_cap": 1, "invalid_actions": 1, "other": 0,
    }  # fmt: skip
    assert s["wall_s"] == 12.5 and s["cost_usd"] == 0.0

    # The same numbers, straight from the SQLite file.
    for t in s["trials"]:
        (cumulative,) = query(
            reflexion_run,
            "SELECT COUNT(DISTINCT game) FROM episodes WHERE won=1 AND trial<=?",
            t["trial"],
        )[0]
        assert t["cumulative_solved"] == cumulative
        (ran,) = query(reflexion_run, "SELECT tasks_json FROM trials WHERE trial=?", t["trial"])[0]
        assert t["tasks_run"] == len(json.loads(ran))
    assert (
        s["errors"]
        == query(reflexion_run, "SELECT COUNT(*) FROM episodes WHERE status='error'")[0][0]
    )
    for name, n in s["failure_classes"].items():
        assert (
            n
            == query(
                reflexion_run,
                "SELECT COUNT(*) FROM episodes WHERE status='done' AND won=0 AND failure_class=?",
                name,
            )[0][0]
        )
    steps, p, c, k = query(
        reflexion_run,
        "SELECT COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), SUM(cached_tokens) FROM steps",
    )[0]
    (n_refl,) = query(reflexion_run, "SELECT COUNT(*) FROM reflections")[0]
    assert n_refl == 5  # one per failed episode: clean t0, heat t1, cool t0, t1, t2
    assert s["tokens"] == {
        "prompt": p + n_refl * REFLECTION_PROMPT_TOKENS,
        "completion": c + n_refl * REFLECTION_COMPLETION_TOKENS,
        "cached_prompt": k,
    }
    assert (p, c, k) == (
        steps * STEP_PROMPT_TOKENS, steps * STEP_COMPLETION_TOKENS, steps * STEP_CACHED_TOKENS,
    )  # fmt: skip
    assert s["tokens_by_purpose"] == {
        "act": {"calls": steps, "prompt": p, "completion": c, "cached_prompt": k,
                "latency_s": pytest.approx(0.25 * steps), "retries": 0, "errors": 0},
        "reflect": {"calls": 5, "prompt": 5 * REFLECTION_PROMPT_TOKENS,
                    "completion": 5 * REFLECTION_COMPLETION_TOKENS, "cached_prompt": 0,
                    "latency_s": 0.0, "retries": 0, "errors": 0},
    }  # fmt: skip

    # Intervals: every trial's cumulative success with its 95% Wilson interval.
    for t in s["trials"]:
        assert t["success_ci"] == pytest.approx(list(wilson_interval(t["cumulative_solved"], 4)))
        assert t["success_ci"][0] <= t["success_rate"] <= t["success_ci"][1]
    assert s["success_ci"] == pytest.approx(list(wilson_interval(3, 4)))
    assert s["solved_at_trial"] == {
        game_id("put", 1): 0, game_id("clean", 2): 1, game_id("heat", 3): 2, game_id("cool", 4): None,
    }  # fmt: skip


def test_judge_and_every_other_call_count_in_tokens_and_cost(tmp_path: Path) -> None:
    run = record_calls(make_run(tmp_path / "llm", standard_tasks(), evaluator="llm"))
    s = summarize_run(run)
    judged = query(run, "SELECT COUNT(*) FROM episodes WHERE judge_verdict IS NOT NULL")[0][0]
    assert judged == 8 and s.tokens_by_purpose["judge"].calls == judged
    by_purpose = s.tokens_by_purpose.values()
    assert s.tokens.prompt == sum(c.prompt for c in by_purpose)
    assert s.tokens.completion == sum(c.completion for c in by_purpose)
    assert s.tokens.cached_prompt == sum(c.cached_prompt for c in by_purpose)
    (steps_p,) = query(run, "SELECT SUM(prompt_tokens) FROM steps")[0]
    assert s.tokens.prompt == (
        steps_p + 5 * REFLECTION_PROMPT_TOKENS + judged * JUDGE_PROMPT_TOKENS
    )
    # the budget check and the progress line read the same totals
    with open_reader(run) as reader:
        assert reader.token_totals() == s.tokens
        assert reader.progress().tokens == s.tokens.total
        assert reader.progress().solved == s.solved == 3


def test_cost_comes_from_the_price_table(tmp_path: Path) -> None:
    pricing = pytest.importorskip("agents.llm.pricing")
    run = make_run(tmp_path / "api", [task("put", 1, "won")], model="openai:gpt-4o", trials=1)
    record_calls(run)
    s = summarize_run(run)
    t = s.tokens
    expected = pricing.cost_usd("openai:gpt-4o", t.prompt, t.completion, t.cached_prompt)
    assert s.cost_usd == pytest.approx(expected) and expected > 0


def test_pngs_are_real_images_of_the_right_size(report_dir: Path) -> None:
    assert PNG_SIZE == (800, 500)
    for name in ("learning_curve.png", "failures.png"):
        assert png_size(report_dir / name) == PNG_SIZE
        img = pixels(report_dir / name)
        assert img.shape[:2] == (PNG_SIZE[1], PNG_SIZE[0])
        assert img[:, :, :3].std() > 0.05, f"{name} is blank"


def test_report_md_has_the_task_type_table(report_dir: Path) -> None:
    md = (report_dir / "report.md").read_text()
    assert "| task type | tasks | solved | success |" in md
    assert "| cool | 1 | 0 | 0.0% |" in md and "| heat | 1 | 1 | 100.0% |" in md
    assert (
        "| trial | tasks run | newly solved | cumulative solved | success | 95% CI | errors |" in md
    )
    assert "| 2 | 2 | 1 | 3 | 75.0% | 30.1–95.4% | 0 |" in md  # trial 2: cumulative 3 of 4
    assert "| act | 41 | 4100 | 3280 | 205 | 0 |" in md  # model calls by purpose
    html = (report_dir / "index.html").read_text()
    assert 'id="reflexsim-data"' in html and "learning_curve" in html


def test_two_runs_give_a_comparison_and_one_curve_with_both_lines(
    reflexion_run: Path, react_run: Path, tmp_path: Path
) -> None:
    out = write_report([reflexion_run, react_run], tmp_path / "cmp")
    assert out == tmp_path / "cmp"
    names = {p.name for p in out.iterdir()}
    assert {"summary-reflexion.json", "summary-react.json", "comparison.json"} <= names
    assert "summary.json" not in names
    rows = json.loads((out / "comparison.json").read_text())["runs"]
    by_arm = {r["arm"]: r for r in rows}
    assert by_arm["reflexion"]["success_trial0"] == by_arm["react"]["success_trial0"] == 0.25
    assert by_arm["reflexion"]["success_last"] == 0.75 and by_arm["react"]["success_last"] == 0.5
    react_summary = json.loads((out / "summary-react.json").read_text())
    tokens = react_summary["tokens"]["prompt"] + react_summary["tokens"]["completion"]
    assert by_arm["react"]["tokens_per_solved"] == pytest.approx(tokens / 2)
    assert react_summary["arm"] == "react" and react_summary["errors"] == 0

    md = (out / "report.md").read_text()
    assert "## Model comparison" in md
    assert "| run | model | arm | tasks | success trial 0 | success last trial |" in md
    assert "| reflexion | scripted:learner | reflexion | 4 | 25.0% | 75.0% (trial 2) |" in md

    # One learning-curve plot, two lines: matplotlib's first two colours both drawn.
    img = pixels(out / "learning_curve.png")
    assert png_size(out / "learning_curve.png") == PNG_SIZE
    assert color_pixels(img, "#1f77b4") > 300 and color_pixels(img, "#ff7f0e") > 300
    single = pixels(write_report([reflexion_run], tmp_path / "one") / "learning_curve.png")
    assert color_pixels(single, "#ff7f0e") < 20  # a single run draws one line
    # ... and its interval as a band: the line colour at 15% over white
    assert color_pixels(single, band_color("#1f77b4"), tol=0.02) > 5000

    # The paired test: same four tasks, at trial 0 and at trial 2 (the last both played).
    paired = json.loads((out / "comparison.json").read_text())["paired"]
    assert [
        (p["a"], p["b"], p["trial"], p["both"], p["only_a"], p["only_b"], p["neither"])
        for p in paired
    ] == [("reflexion", "react", 0, 1, 0, 0, 3), ("reflexion", "react", 2, 2, 1, 0, 1)]
    assert [p["p_value"] for p in paired] == [1.0, 1.0]  # one discordant task: p = 2 * 1/2
    assert by_arm["reflexion"]["success_last_ci"] == pytest.approx(list(wilson_interval(3, 4)))
    assert "| reflexion | react | 2 | 4 | 2 | 1 | 0 | 1 | 1 |" in md


def band_color(hex_color: str, alpha: float = 0.15) -> str:
    rgb = [int(hex_color[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(alpha * c + (1 - alpha) * 255):02x}" for c in rgb)


def test_a_run_still_being_written(tmp_path: Path) -> None:
    run = make_run(
        tmp_path / "live",
        [task("put", 1, "won"), task("cool", 2, "running")],
        trials=1,
        wall_s=None,
        complete=False,
    )
    s = summarize_run(run)
    assert s.trials[0].incomplete == 1 and s.trials[0].cumulative_solved == 1
    assert s.status.status == "interrupted" and s.wall_s > 0
    assert s.failure_classes["other"] == 0 and s.errors == 0


def test_bad_run_dir_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(RunStoreError, match="not a run directory"):
        write_report([tmp_path])
    with pytest.raises(RunStoreError, match="at least one"):
        write_report([])


class _Recorder:
    """Wraps the real actor backend and keeps every act prompt it was sent."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.prompts: dict[tuple[str, int, int], str] = {}

    def generate(self, requests):
        for r in requests:
            if r.purpose == "act":
                self.prompts[(r.site.game, r.site.trial, r.site.step)] = r.prompt
        return self.inner.generate(requests)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.slow
def test_a_real_run_report_and_its_prompts(
    generated_games: Path, tmp_path: Path, monkeypatch
) -> None:
    """A real run (generated ALFWorld games, the scripted learner): the report agrees with the
    store, and the viewer's prompt of every step is exactly what the model was sent."""
    from experiments import runner, session
    from experiments.config import RunConfig
    from experiments.store import RunStore
    from experiments.viewer.data import step_prompt

    recorders: list[_Recorder] = []
    real = runner.make_backends

    def recording(cfg, truth):
        actor, reflector = real(cfg, truth)
        recorders.append(_Recorder(actor))
        return recorders[-1], reflector

    monkeypatch.setattr(runner, "make_backends", recording)
    cfg = RunConfig.of(
        model="scripted:learner", data=str(generated_games), split="eval_out_of_distribution",
        games=2, trials=2, workers=1, run_dir=str(tmp_path / "real"),
    )  # fmt: skip
    run_dir = session.run(cfg)
    s = json.loads((write_report([run_dir]) / "summary.json").read_text())
    assert s["total_tasks"] == 2 and s["arm"] == "reflexion" and s["errors"] == 0
    for t in s["trials"]:
        (cumulative,) = query(
            run_dir,
            "SELECT COUNT(DISTINCT game) FROM episodes WHERE won=1 AND trial<=?",
            t["trial"],
        )[0]
        assert t["cumulative_solved"] == cumulative
    assert s["trials"][-1]["cumulative_solved"] >= 1  # the learner wins once it has a reflection
    p, c = query(run_dir, "SELECT SUM(prompt_tokens), SUM(completion_tokens) FROM steps")[0]
    assert p > 0 and c > 0
    calls = query(run_dir, "SELECT SUM(prompt_tokens), SUM(completion_tokens) FROM model_calls")
    assert (s["tokens"]["prompt"], s["tokens"]["completion"]) == tuple(v or 0 for v in calls[0])

    sent = recorders[0].prompts
    store = RunStore(run_dir, readonly=True)
    try:
        checked = 0
        for row in store.episodes():
            steps = store.steps(row.episode_id)
            for i in range(len(steps)):
                assert step_prompt(store, row, steps, i).shown == sent[(row.game, row.trial, i)]
                checked += 1
    finally:
        store.close()
    assert checked == len(sent) > 0


# -- the committed results ------------------------------------------------------------------------
SAME_KEYS = ("total_tasks", "solved", "success_rate", "by_task_type", "tokens", "errors",
             "episodes", "wall_s", "model", "arm")  # fmt: skip


@pytest.mark.parametrize("run_dir", COMMITTED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_results_still_render(run_dir: Path, tmp_path: Path) -> None:
    """Each committed run renders from its run.sqlite with the numbers of its committed
    summary.json, and the viewer builds an episode's data and prompts (scale-cpu's valid_seen
    runs are version-1 stores, read as they are through views; the others are current)."""
    from experiments.viewer.data import load_episode, step_prompt

    copy = tmp_path / run_dir.name
    copy.mkdir()
    shutil.copy(run_dir / "run.sqlite", copy / "run.sqlite")
    s = json.loads((write_report([copy]) / "summary.json").read_text())
    committed = json.loads((run_dir / "summary.json").read_text())
    assert {k: s[k] for k in SAME_KEYS} == {k: committed[k] for k in SAME_KEYS}
    # the same failures; only those stored as "other" may now be the arm's own ends (LATS)
    failures, before = s["failure_classes"], committed["failure_classes"]
    assert sum(failures.values()) == sum(before.values())
    assert {c: n for c, n in before.items() if c != "other"} == {
        c: failures[c] for c in before if c != "other"
    }
    assert [t["cumulative_solved"] for t in s["trials"]] == [
        t["cumulative_solved"] for t in committed["trials"]
    ]
    assert all(len(t["success_ci"]) == 2 for t in s["trials"])
    assert s["tokens_by_purpose"]["act"]["calls"] > 0

    with open_reader(copy) as reader:
        assert reader.schema_version == (1 if run_dir in COMMITTED_V1 else 2)
        # made before task ends were kept: complete by its finished episodes, not a flag
        assert reader.run_state().status == "complete"
        # the last episode with steps (a run stopped at its deadline may end with an empty one)
        episode = next(e for e in reversed(reader.outcomes()) if reader.steps(e.episode_id))
        detail = load_episode(reader, episode.episode_id)
        row = reader.episode(episode.episode_id)
        steps = reader.steps(episode.episode_id)
        assert row is not None
        last = step_prompt(reader, row, steps, len(steps) - 1)
    assert detail is not None and len(detail["steps"]) == len(steps) > 0
    assert last.shown.startswith(row.prompt_prefix)
    # committed before requests were recorded: rebuilt, and marked so in the page and the API
    assert last.rebuilt and detail["steps"][-1]["prompt_source"] == "rebuilt"
    assert all(not c["recorded"] for c in detail["calls"])


@pytest.mark.skipif(not COMMITTED, reason="no committed results in this checkout")
def test_reading_committed_results_in_place_changes_nothing() -> None:
    run_dir = COMMITTED[0]
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in run_dir.iterdir()}
    summarize_run(run_dir)
    with open_reader(run_dir) as reader:
        reader.token_totals()
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in run_dir.iterdir()}
    assert after == before


LATS_RUN = RESULTS / "arms-cpu-valid_seen" / "gemma3-270m-lats-reflexion"


@pytest.mark.skipif(not LATS_RUN.is_dir(), reason="no committed LATS run in this checkout")
def test_committed_lats_failures_are_classed_by_the_arms_ends() -> None:
    """The committed LATS + Reflexion run stored its 12 failures as "other" with the search's
    reason in the verdict: read in place, the report counts them as the search end LATS
    declares (iteration budget), and the viewer shows the same class."""
    from experiments.viewer.data import run_index

    s = summarize_run(LATS_RUN)
    assert s.arm == "lats+reflexion" and sum(s.failure_classes.values()) == 12
    assert s.failure_classes["search_iterations"] == 12 and s.failure_classes["other"] == 0
    with open_reader(LATS_RUN) as reader:
        shown = {e["failure_class"] for e in run_index(reader, 0, "lats", None)["episodes"]}
    assert shown - {None} == {"search_iterations"}
