"""The engine's scheduling on a real worker pool: an episode waiting for its turn resets its game
in a spare slot, and no more than ``concurrency`` episodes play (send model requests) at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agents.episode import EpisodeContext, EpisodeEnd, EpisodeSpec
from agents.llm.scripted import ScriptedBackend
from envs.aio import AsyncEnvPool
from envs.pool import EnvPool
from experiments.engine import Engine, ModelClient
from experiments.store import RunStore
from tests.envs.test_pool import SLEEPY


class Probe:
    """Resets, then plays for a while (its model time): how many played at once."""

    def __init__(self) -> None:
        self.playing = 0
        self.most = 0

    async def play(self, episode: EpisodeContext) -> EpisodeEnd:
        await episode.reset()
        self.playing += 1
        self.most = max(self.most, self.playing)
        await asyncio.sleep(0.3)
        self.playing -= 1
        return EpisodeEnd(won=False)


def test_waiting_episodes_reset_ahead_and_only_concurrency_of_them_play(tmp_path: Path) -> None:
    games = ["a", "b", "c", "d"]
    specs = [EpisodeSpec(f"{g}#t0", g, "examine", 0, "prefix") for g in games]
    probe = Probe()
    store = RunStore(tmp_path / "run", create=True)
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
