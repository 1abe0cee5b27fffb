"""The engine's scheduling on a real worker pool: an episode waiting for its turn resets its game
in a spare slot, and no more than ``concurrency`` episodes play (send model requests) at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from agents.episode import EpisodeContext, EpisodeEnd, EpisodeSpec
from agents.llm.scripted import ScriptedBackend
from envs.aio import AsyncEnvPool
from envs.pool import EnvPool
from experiments.engine import Engine, ModelClient
from experiments.store import RunStore
from tests.envs.test_pool import SLEEPY


class Probe:
    """Resets, then plays for a while (its model time): how many played at once. With
    ``started``, the first episode plays until that many episodes have reset (their rows are
    made), so the order does not hang on how fast a loaded machine resets; a hang fails."""

    def __init__(self, started: tuple[Callable[[], int], int] | None = None) -> None:
        self.playing = 0
        self.most = 0
        self.started = started

    async def play(self, episode: EpisodeContext) -> EpisodeEnd:
        await episode.reset()
        self.playing += 1
        self.most = max(self.most, self.playing)
        await asyncio.sleep(0.3)
        if self.started is not None:
            count, want = self.started
            self.started = None  # the first episode only
            for _ in range(3000):  # 30 s: only tells a hang from an order
                if count() >= want:
                    break
                await asyncio.sleep(0.01)
        self.playing -= 1
        return EpisodeEnd(won=False)


def test_waiting_episodes_reset_ahead_and_only_concurrency_of_them_play(tmp_path: Path) -> None:
    games = ["a", "b", "c", "d"]
    specs = [EpisodeSpec(f"{g}#t0", g, "examine", 0, "prefix") for g in games]
    store = RunStore(tmp_path / "run", create=True)
    probe = Probe(started=(lambda: len(store.episodes()), 3))
    with EnvPool(SLEEPY, workers=2, slots=3, timeout_s=60) as pool:
        engine = Engine(
            store,
            ModelClient(ScriptedBackend("random")),
            AsyncEnvPool(pool),
            arm="react",
            concurrency=1,
        )

        async def play_all() -> None:
            await asyncio.gather(*(engine.play(s, probe) for s in specs))  # type: ignore[arg-type]

        asyncio.run(play_all())
    assert probe.most == 1  # one plays at a time
    episodes = sorted(store.episodes(), key=lambda e: e.finished_at or 0)
    store.close()
    assert len(episodes) == 4 and all(e.status == "done" for e in episodes)
    # an episode's row is made when its reset is back: before the first episode ended, the two
    # spare slots had reset their games (and only they: the fourth waited for a free slot)
    first_end = episodes[0].finished_at or 0
    assert sum(e.started_at < first_end for e in episodes) == 3
