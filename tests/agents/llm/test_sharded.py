"""Sharding one run across two real local servers: split, stickiness per game, failover."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.llm import make_backend
from agents.llm.base import CallSite, GenerationConfig, Request
from agents.llm.sharded import ShardedBackend, ranking, routing_key
from experiments.serve import free_port

ROOT = Path(__file__).resolve().parent.parent.parent.parent

# A fault server (no faults) in its own process, answering with its name: killing the process
# closes its kept-alive connections too, as a crashed server would.
SERVER = """
import signal, sys
sys.path.insert(0, sys.argv[3])
from tests.support.fault_server import FaultServer
name = sys.argv[1]
FaultServer(answer=lambda text: " " + name, port=int(sys.argv[2])).start()
print("ready", flush=True)
signal.pause()
"""


class Server:
    def __init__(self, name: str, port: int | None = None) -> None:
        self.name = name
        self.port = port or free_port()
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> Server:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, self.name, str(self.port), str(ROOT)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture
def servers() -> Iterator[tuple[Server, Server]]:
    a, b = Server("A").start(), Server("B").start()
    try:
        yield a, b
    finally:
        a.kill()
        b.kill()


def batch(games: list[str], step: int) -> list[Request]:
    return [
        Request(GenerationConfig(max_tokens=8), prompt=f"{g} step {step}", site=CallSite(game=g))
        for g in games
    ]


GAMES = [f"task-{i}/trial_T{i}" for i in range(12)]


def test_requests_split_across_servers_and_each_game_stays_on_one(servers):
    a, b = servers
    backend = make_backend("openai:test", base_url=f"{a.url},{b.url}")
    assert isinstance(backend, ShardedBackend)
    try:
        seen: dict[str, set[str]] = {g: set() for g in GAMES}
        for step in range(3):
            for game, c in zip(GAMES, backend.generate(batch(GAMES, step)), strict=True):
                seen[game].add(c.text.strip())
                assert c.sent["server"] in (a.url, b.url)
        assert all(len(names) == 1 for names in seen.values()), seen
        on = {g: next(iter(names)) for g, names in seen.items()}
        assert set(on.values()) == {"A", "B"}  # both servers got a share
        stats = backend.stats()
        assert stats["requests"] == {
            a.url: 3 * sum(v == "A" for v in on.values()),
            b.url: 3 * sum(v == "B" for v in on.values()),
        }
        # the mapping is the rendezvous hash of the game, whatever order the URLs are given in
        urls = [a.url, b.url]
        for g in GAMES:
            first = urls[ranking(routing_key(batch([g], 0)[0]), urls)[0]]
            assert first == (a.url if on[g] == "A" else b.url)
    finally:
        backend.close()
    reordered = make_backend("openai:test", base_url=f"{b.url},{a.url}")
    try:
        again = [c.text.strip() for c in reordered.generate(batch(GAMES, 9))]
        assert again == [on[g] for g in GAMES]
    finally:
        reordered.close()


def test_failover_when_a_server_stops_and_back_when_it_returns(servers):
    a, b = servers
    backend = make_backend("openai:test", base_url=f"{a.url},{b.url}", down_for_s=1.0)
    try:
        on = {
            g: c.text.strip() for g, c in zip(GAMES, backend.generate(batch(GAMES, 0)), strict=True)
        }
        on_b = [g for g in GAMES if on[g] == "B"]
        assert on_b and len(on_b) < len(GAMES)

        b.kill()
        out = backend.generate(batch(GAMES, 1))
        assert [c.text.strip() for c in out] == ["A"] * len(GAMES)  # nothing lost
        for g, c in zip(GAMES, out, strict=True):
            if on[g] == "B":
                assert c.sent["failed_over_from"] == b.url
            else:
                assert "failed_over_from" not in c.sent and c.retries == 0
        # the first requests to reach B fail and count a retry; requests that start after B was
        # marked down go straight to A (concurrent shares), with nothing to retry
        assert sum(c.retries for g, c in zip(GAMES, out, strict=True) if on[g] == "B") >= 1
        stats = backend.stats()
        assert stats["failed_over"][b.url] == len(on_b)
        assert stats["outages"][b.url] == 1 and stats["down"] == [b.url]

        # while B is down its games go straight to A: B is not tried again (no failed attempt)
        again = backend.generate(batch(on_b, 2))
        assert [c.text.strip() for c in again] == ["A"] * len(on_b)
        assert all(c.retries == 0 and c.sent["failed_over_from"] == b.url for c in again)
        assert backend.stats()["outages"][b.url] == 1

        b.start()  # back on the same port
        time.sleep(1.1)  # down_for_s has passed: B is tried again
        back = [c.text.strip() for c in backend.generate(batch(GAMES, 3))]
        assert back == [on[g] for g in GAMES]
        assert backend.stats()["down"] == []
    finally:
        backend.close()


def test_a_run_through_the_runner_is_sharded_by_game(servers, generated_games, tmp_path):
    from experiments.config import RunConfig
    from experiments.session import run
    from experiments.store import RunStore

    a, b = servers

    def served_by(run_dir: Path) -> dict[str, set[str]]:
        store = RunStore(run_dir, readonly=True)
        try:
            assert store.get_meta("manifest")["actor"]["backend"] == "sharded"
            out: dict[str, set[str]] = {}
            for e in store.episodes():
                assert e.status == "done", (e.episode_id, e.status)
                out[e.game] = {s.raw_output.strip() for s in store.steps(e.episode_id)}
            return out
        finally:
            store.close()

    cfg = RunConfig.of(
        model="openai:test", base_url=f"{a.url},{b.url}", data=str(generated_games),
        split="eval_out_of_distribution", agent="react", trials=1, max_steps=3, concurrency=6,
        run_dir=str(tmp_path / "both"),
    )  # fmt: skip
    per_game = served_by(run(cfg))
    assert len(per_game) == 6
    assert all(len(names) == 1 for names in per_game.values()), per_game
    # each game on its rendezvous-first server (with random ports, all six may land on one)
    urls, names = [a.url, b.url], ["A", "B"]
    expected = {g: {names[ranking(routing_key(batch([g], 0)[0]), urls)[0]]} for g in per_game}
    assert per_game == expected

    b.kill()
    cfg = RunConfig.of(**{**cfg.to_dict(), "run_dir": str(tmp_path / "one-down")})
    per_game = served_by(run(cfg))
    assert all(names == {"A"} for names in per_game.values()), per_game


def test_a_request_error_on_a_live_server_is_raised_not_failed_over():
    from agents.llm.base import BackendError
    from tests.support.fault_server import FaultServer

    # server A rejects our key (401, not retryable) but answers the probe: the request is at fault
    with FaultServer(api_key="sk-other-key-0123456789") as a, FaultServer() as b:
        backend = make_backend("openai:test", base_url=f"{a.url},{b.url}", max_retries=1)
        try:
            urls = [a.url, b.url]
            on_a = [g for g in GAMES if ranking(f"game:{g}", urls)[0] == 0]
            with pytest.raises(BackendError, match="401"):
                backend.generate(batch(on_a[:1], 0))
            assert b.events == [] and backend.stats()["down"] == []
            assert backend.stats()["failed_over"] == {a.url: 0, b.url: 0}
        finally:
            backend.close()
