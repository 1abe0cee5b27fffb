"""LATS (Language Agent Tree Search) over the episode context: sample several candidate actions
per step, value them, select by UCT, roll out, back-propagate, and backtrack.

One iteration:

1. **Select**: from the root, descend to the child with the highest UCT score
   (mean reward + ``exploration`` * sqrt(ln N(parent) / (N(child) + 1)); a child never visited
   counts its value estimate as its mean), skipping dead subtrees, until a node that has not
   been expanded.
2. **Execute** it if it has not been: restore its parent with ``ctx.reset(replay=actions)``
   (the replayed actions are env steps of this iteration: ``replay_steps``), then step it.
3. **Expand**: ``lats_n`` candidates in one request (a backend that returns fewer gets the rest as
   single requests), parsed and grounded like ReAct's actions, duplicates merged; the value
   function (:mod:`agents.values`) scores each before it is executed.
4. **Roll out**: from there, execute the best-valued child and expand it, until a terminal state
   (won, the evaluator's failure verdict, the step cap), ``lats_rollout_depth`` steps, or a node
   whose candidates all score 0 (the value function sees no way on). The rollout needs no
   restore: the env is already where it continues.
5. **Back-propagate** the reward, which is 1 for ``won`` and 0 for any other terminal state
   (never ``done``); a rollout that stopped early propagates its last node's value estimate.
6. **Reflect** on a rollout that ended in failure: the reflection is kept on that node, and the
   last ``lats_reflections`` of them are shown in the expansion prompt (a memory block), so the
   proposer sees why earlier branches failed.

Children are executed lazily (only when selected or rolled out), because restoring a node costs a
reset and a replay of its path; that is also why values score a candidate from its parent's state.
Budgets per episode: iterations, nodes, env steps (replays included), tokens, wall time.
The arms' options are the ``lats`` config section (:class:`LatsConfig`), which is also the
search's settings.

Every iteration's new and changed nodes and its costs are saved through the :class:`SearchLog`
(the run store) as one unit; a resumed episode rebuilds its tree and continues from the next
iteration. When the search ends, the path to the won node (else the most visited path) is
written as the episode's steps, so reports, exports and replays read a LATS episode like any
other.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from agents.arm import Arm, ArmContext, SearchLog
from agents.episode import EpisodeContext, EpisodeEnd
from agents.evaluators import ACTOR_ENDS, classify_failure
from agents.llm.base import Completion, Request
from agents.llm.ground_truth import NO_GROUND_TRUTH, GroundTruth
from agents.memory_policy import NO_MEMORY, REFLEXION
from agents.options import option
from agents.parsing import ParsedAction
from agents.react import (
    NOTHING_HAPPENS,
    THOUGHT_OBSERVATION,
    Actor,
    ActorSettings,
    actor_request,
    make_step,
)
from agents.reflexion import ReflexionSettings, prompt_prefix, reflect
from agents.values import VALUES, Candidate, NodeView, ValueFunction, make_value
from memory.records import (
    EndClass,
    EnvReply,
    FailureClass,
    Reflection,
    SearchEnd,
    SearchIteration,
    SearchNode,
    SearchTree,
    Step,
    StepKind,
    classify_end,
    env_actions,
)

_SEARCH = "search: "  # how a search's end starts the episode's verdict
# Why a search ends without a win (its verdict: "search: <words> (<the budget>)"), by class.
_ENDS = {
    FailureClass.SEARCH_ITERATIONS: "iteration budget",
    FailureClass.SEARCH_NODES: "node budget",
    FailureClass.SEARCH_ENV_STEPS: "env step budget",
    FailureClass.SEARCH_TOKENS: "token budget",
    FailureClass.SEARCH_TIME: "wall-time budget",
    FailureClass.SEARCH_EXHAUSTED: "every branch failed",
}
SEARCH_ENDS = tuple(EndClass(c, f"{_SEARCH}{words}") for c, words in _ENDS.items())


@dataclass(frozen=True)
class LatsConfig:
    """Language Agent Tree Search (agents lats, lats+reflexion); budgets are per episode."""

    lats_n: int = option(
        5,
        "candidate actions sampled per expansion (one request; n requests where the backend "
        "cannot sample n at once)",
        minimum=1,
    )
    lats_iterations: int = option(30, "search iterations per episode at most", minimum=1)
    lats_value: str = option(
        "llm",
        "value of a candidate: llm (self-evaluation 1-10), sc (self-consistency of the "
        "samples), heuristic (no model), oracle (distance along the game's known solution: "
        "privileged, an upper bound for experiments and tests)",
        choices=VALUES,
    )
    lats_temperature: float = option(1.0, "sampling temperature of the expansions", minimum=0.0)
    lats_exploration: float = option(1.0, "UCT exploration constant", minimum=0.0)
    lats_reflections: int = option(
        2, "reflections on failed rollouts shown in the expansion prompt (0: none)", minimum=0
    )
    lats_rollout_depth: int | None = option(
        None, "steps per rollout at most (default: to a terminal state)", minimum=0
    )
    lats_max_nodes: int | None = option(None, "tree nodes per episode at most", minimum=1)
    lats_max_env_steps: int | None = option(
        None, "env steps per episode at most, replays included", minimum=1
    )
    lats_max_tokens: int | None = option(None, "tokens per episode at most", minimum=1)
    lats_max_seconds: float | None = option(None, "wall time per episode at most", minimum=0.0)


@dataclass(eq=False)
class Node:
    """A node of the tree while the search runs (saved as a SearchNode)."""

    id: int
    parent: Node | None
    depth: int
    parsed: ParsedAction | None  # None for the root
    value: float = 0.0
    samples: int = 1
    iteration: int = 0
    step: Step | None = None  # once executed (the root has none)
    visits: int = 0
    total: float = 0.0
    children: list[Node] = field(default_factory=list)
    expanded: bool = False
    terminal: bool = False
    won: bool = False
    dead: bool = False  # a failed terminal state, or every child dead
    reflection: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    end: EpisodeEnd | None = None

    @property
    def executed(self) -> bool:
        return self.parent is None or self.step is not None

    @property
    def mean(self) -> float:
        return self.total / self.visits if self.visits else self.value

    def path(self) -> list[Node]:
        """The nodes from the root's first child down to this one."""
        out: list[Node] = []
        node: Node | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def steps(self) -> list[Step]:
        return [n.step for n in self.path() if n.step is not None]

    def record(self, observation: str) -> SearchNode:
        parsed, step = self.parsed, self.step
        return SearchNode(
            node_id=self.id,
            parent_id=self.parent.id if self.parent else None,
            depth=self.depth,
            kind=parsed.kind.value if parsed else "",
            raw_output=parsed.raw if parsed else "",
            action=parsed.action if parsed else "",
            observation=step.observation if step else (observation if not parsed else None),
            admissible=step.admissible if step else True,
            value=self.value,
            visits=self.visits,
            total=self.total,
            samples=self.samples,
            terminal=self.terminal,
            won=self.won,
            reflection=self.reflection,
            iteration=self.iteration,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
        )


class LatsAgent:
    """Plays one episode as a tree search; see the module docstring."""

    def __init__(
        self,
        actor: ActorSettings,
        reflexion: ReflexionSettings,  # how failed rollouts are reflected on
        settings: LatsConfig = LatsConfig(),
        log: SearchLog | None = None,
        ground_truth: GroundTruth = NO_GROUND_TRUTH,
    ) -> None:
        self.settings = settings
        self.reflexion = reflexion
        self.log = log
        self.actor = Actor(actor)
        self.value: ValueFunction = make_value(settings.lats_value, ground_truth)
        generation = replace(
            actor.generation, temperature=settings.lats_temperature, n=settings.lats_n
        )
        self.sampling = replace(actor, generation=generation)

    async def play(self, ctx: EpisodeContext) -> EpisodeEnd:
        return await _Search(self, ctx).run()


class _Search:
    """One episode's search: the tree lives here, in local state."""

    def __init__(self, agent: LatsAgent, ctx: EpisodeContext) -> None:
        self.agent = agent
        self.s = agent.settings
        self.ctx = ctx
        self.nodes: list[Node] = []
        self.dirty: set[int] = set()
        self.at: Node | None = None  # the node the env is in
        self.state: EnvReply | None = None  # the env's last reply (at ``self.at``)
        self.observation = ""
        self.iteration = 0
        self.env_steps = self.replay_steps = self.resets = 0
        self.tokens = 0
        self.spent_s = 0.0  # wall time of earlier runs of this search (resume)
        self.started = time.monotonic()
        self._last_leaf: Node | None = None  # where the previous iteration ended

    # -- the search --------------------------------------------------------------------------
    async def run(self) -> EpisodeEnd:
        ctx, spec = self.ctx, self.ctx.spec
        reply = await ctx.reset()
        self.observation = spec.resumed_observation or reply.observation
        tree = self.agent.log.search_tree(spec.episode_id) if self.agent.log else None
        root = self._rebuild(tree) if tree else self._new(None, None, 0.0, 1)
        self.at, self.state = root, reply
        if tree is not None and tree.end is not None:
            return self._finish(self.nodes[tree.end.best_node], tree.end.reason, saved=True)
        won: Node | None = None
        reason = f"{_ENDS[FailureClass.SEARCH_ITERATIONS]} ({self.s.lats_iterations})"
        while won is None:
            stop = self._budget_spent()
            if stop is not None:
                reason = stop
                break
            if root.dead:
                reason = _ENDS[FailureClass.SEARCH_EXHAUSTED]
                break
            won = await self._iterate(root)
        return self._finish(won or self._most_visited(root), "won" if won else reason)

    async def _iterate(self, root: Node) -> Node | None:
        """One iteration (module docstring); the won node when it found one."""
        counts = (self.env_steps, self.replay_steps, self.resets, self.tokens, len(self.nodes))
        started = time.monotonic()
        previous = self._last_leaf
        node = root
        while node.expanded and not node.terminal:
            parent = node
            node = max((c for c in node.children if not c.dead), key=lambda c: self._uct(parent, c))
        selected = node
        await self._execute(node)
        steps = 0
        while not node.terminal and self._budget_spent() is None:
            if not node.expanded:
                await self._restore(node)
                await self._expand(node)
            live = [c for c in node.children if not c.dead]
            depth = self.s.lats_rollout_depth
            if not live or (depth is not None and steps >= depth):
                break
            best = max(live, key=lambda c: c.value)
            if best.value <= 0.0:
                break  # the value function sees no way on from here
            node = best
            await self._execute(node)
            steps += 1
        reward = (1.0 if node.won else 0.0) if node.terminal else node.mean
        for n in [*reversed(node.path()), root]:
            n.visits += 1
            n.total += reward
            self.dirty.add(n.id)
        if node.terminal and not node.won:
            self._mark_dead(node)
            if self.s.lats_reflections > 0:
                await self._reflect(node)
        self._last_leaf = node
        record = SearchIteration(
            iteration=self.iteration,
            selected=selected.id,
            leaf=node.id,
            reward=reward,
            env_steps=self.env_steps - counts[0],
            replay_steps=self.replay_steps - counts[1],
            resets=self.resets - counts[2],
            tokens=self.tokens - counts[3],
            nodes_added=len(self.nodes) - counts[4],
            backtrack=previous is not None and previous not in [selected, *selected.path()],
            elapsed_s=time.monotonic() - started,
        )
        self._save(record)
        self.iteration += 1
        return node if node.won else None

    def _uct(self, parent: Node, child: Node) -> float:
        bonus = math.sqrt(math.log(parent.visits + 1) / (child.visits + 1))
        return child.mean + self.s.lats_exploration * bonus

    def _mark_dead(self, node: Node | None) -> None:
        while node is not None and (node.terminal or (node.expanded and node.children)):
            if not node.terminal and not all(c.dead for c in node.children):
                return
            node.dead = True
            self.dirty.add(node.id)
            node = node.parent

    def _budget_spent(self) -> str | None:
        s = self.s
        if self.iteration >= s.lats_iterations:
            return f"{_ENDS[FailureClass.SEARCH_ITERATIONS]} ({s.lats_iterations})"
        if s.lats_max_nodes is not None and len(self.nodes) >= s.lats_max_nodes:
            return f"{_ENDS[FailureClass.SEARCH_NODES]} ({s.lats_max_nodes})"
        spent = self.env_steps + self.replay_steps
        if s.lats_max_env_steps is not None and spent >= s.lats_max_env_steps:
            return (
                f"{_ENDS[FailureClass.SEARCH_ENV_STEPS]} ({s.lats_max_env_steps}, replays included)"
            )
        if s.lats_max_tokens is not None and self.tokens >= s.lats_max_tokens:
            return f"{_ENDS[FailureClass.SEARCH_TOKENS]} ({s.lats_max_tokens})"
        elapsed = self.spent_s + time.monotonic() - self.started
        if s.lats_max_seconds is not None and elapsed >= s.lats_max_seconds:
            return f"{_ENDS[FailureClass.SEARCH_TIME]} ({s.lats_max_seconds:g} s)"
        return None

    # -- env ---------------------------------------------------------------------------------
    async def _restore(self, node: Node) -> None:
        """Put the env in ``node``'s state: reset and replay its path's actions (nothing to do
        when the env is there, or in a state with the same actions: thoughts change nothing)."""
        actions = env_actions(node.steps())
        if self.at is node or (self.at is not None and env_actions(self.at.steps()) == actions):
            self.at = node
            return
        self.state = await self.ctx.reset(replay=actions)
        self.resets += 1
        self.replay_steps += len(actions)
        self.at = node

    async def _execute(self, node: Node) -> None:
        """Step a node that has not been executed (restoring its parent first)."""
        if node.executed:
            return
        assert node.parent is not None and node.parsed is not None
        await self._restore(node.parent)
        assert self.state is not None
        parsed, index = node.parsed, node.depth - 1
        cost = Completion(parsed.raw, prompt_tokens=node.prompt_tokens,
                          completion_tokens=node.completion_tokens)  # fmt: skip
        truncated = False
        if parsed.kind == StepKind.ACT:
            admissible = parsed.action in self.state.admissible
            self.state = await self.ctx.step(parsed.action)
            self.env_steps += 1
            node.step = make_step(
                index, parsed, cost, self.state.observation, admissible, self.state
            )
            truncated = self.state.truncated
        else:
            thought = parsed.kind == StepKind.THINK
            observation = THOUGHT_OBSERVATION if thought else NOTHING_HAPPENS
            node.step = make_step(index, parsed, cost, observation, thought)
        self.at = node
        end = self.agent.actor.check_end(node.steps(), truncated)
        if end is not None:
            node.terminal, node.won, node.end = True, end.won, end
        self.dirty.add(node.id)

    # -- model -------------------------------------------------------------------------------
    async def _generate(self, request: Request) -> Completion:
        completion = await self.ctx.generate(request)
        self.tokens += completion.prompt_tokens + completion.completion_tokens
        return completion

    async def _expand(self, node: Node) -> None:
        """Sample ``n`` candidates at ``node`` (the env is there), merge, value, add them."""
        assert self.state is not None and self.at is node
        spec, s = self.ctx.spec, self.s
        steps = node.steps()
        seed = (spec.seed or 0) + 7919 * node.id
        request = actor_request(
            self.agent.sampling, self._prefix(), self.observation, steps, self.state,
            game=spec.game, trial=spec.trial, seed=seed, episode=spec.episode_id,
        )  # fmt: skip
        first = await self._generate(request)
        texts = [first.text, *first.alternatives][: s.lats_n]
        for k in range(len(texts), s.lats_n):  # a backend that cannot sample n at once
            one = replace(request, config=replace(request.config, n=1, seed=seed + k))
            texts.append((await self._generate(one)).text)
        merged: dict[tuple[str, str], tuple[ParsedAction, int]] = {}
        for text in texts:
            parsed = self.agent.actor.parse(text, self.state.admissible)
            key = (parsed.kind.value, parsed.action)
            seen = merged.get(key)
            merged[key] = (seen[0] if seen else parsed, (seen[1] if seen else 0) + 1)
        candidates = [
            Candidate(p.kind.value, p.action, p.raw, count) for p, count in merged.values()
        ]
        view = NodeView(
            observation=self.observation,
            steps=tuple(steps),
            state=self.state,
            max_steps=self.agent.actor.settings.max_steps,
            game=spec.game,
            trial=spec.trial,
            seed=spec.seed,
            site=request.site,
        )
        values = await self.agent.value.score(self.ctx, view, candidates)
        for i, ((parsed, count), value) in enumerate(zip(merged.values(), values, strict=True)):
            child = self._new(node, parsed, value, count)
            if i == 0:
                child.prompt_tokens = first.prompt_tokens
                child.completion_tokens = first.completion_tokens
        node.expanded = True
        self.dirty.add(node.id)

    def _prefix(self) -> str:
        """The expansion prompt's fixed part: the episode's, plus the last failed-rollout
        reflections when there are any (made as the trial loop makes every actor's prefix)."""
        spec = self.ctx.spec
        shown = [n.reflection for n in self.nodes if n.reflection][-self.s.lats_reflections :]
        if not shown or self.s.lats_reflections == 0:
            return spec.prefix
        items = [
            Reflection(spec.game, spec.trial, spec.episode_id, "lats", "", text) for text in shown
        ]
        return prompt_prefix(self.agent.reflexion, spec.task_type, [*spec.memory, *items])

    async def _reflect(self, node: Node) -> None:
        spec = self.ctx.spec
        made = await reflect(
            _Counted(self),
            self.agent.reflexion,
            task=spec.game,
            trial=spec.trial,
            episode_id=spec.episode_id,
            observation=self.observation,
            steps=node.steps(),
        )
        node.reflection = made.reflection.text
        self.dirty.add(node.id)

    # -- the tree ----------------------------------------------------------------------------
    def _new(self, parent: Node | None, parsed: ParsedAction | None, value: float,
             samples: int) -> Node:  # fmt: skip
        node = Node(
            id=len(self.nodes),
            parent=parent,
            depth=parent.depth + 1 if parent else 0,
            parsed=parsed,
            value=value,
            samples=samples,
            iteration=self.iteration,
        )
        self.nodes.append(node)
        if parent is not None:
            parent.children.append(node)
        self.dirty.add(node.id)
        return node

    def _save(self, iteration: SearchIteration | None) -> None:
        if self.agent.log is None:
            return
        records = [self.nodes[i].record(self.observation) for i in sorted(self.dirty)]
        self.agent.log.save_search(self.ctx.spec.episode_id, records, iteration)
        self.dirty.clear()

    def _rebuild(self, tree: SearchTree) -> Node:
        """The stored tree as live nodes (a resumed episode continues its search)."""
        for r in tree.nodes:
            parent = self.nodes[r.parent_id] if r.parent_id is not None else None
            parsed = None
            if parent is not None:
                parsed = ParsedAction(StepKind(r.kind), r.raw_output, r.action)
            node = Node(r.node_id, parent, r.depth, parsed, r.value, r.samples, r.iteration)
            node.visits, node.total = r.visits, r.total
            node.terminal, node.won, node.reflection = r.terminal, r.won, r.reflection
            node.prompt_tokens, node.completion_tokens = r.prompt_tokens, r.completion_tokens
            self.nodes.append(node)
            if parent is not None:
                parent.children.append(node)
                parent.expanded = True
                if r.observation is not None:
                    node.step = Step(
                        index=r.depth - 1, kind=r.kind, raw_output=r.raw_output, action=r.action,
                        observation=r.observation, admissible=r.admissible,
                        prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens,
                        won=r.won,
                    )  # fmt: skip
        for node in reversed(self.nodes):
            if node.terminal and not node.won:
                node.dead = True
            elif node.expanded and node.children and all(c.dead for c in node.children):
                node.dead = True
        self.iteration = len(tree.iterations)
        for it in tree.iterations:
            self.env_steps += it.env_steps
            self.replay_steps += it.replay_steps
            self.resets += it.resets
            self.tokens += it.tokens
            self.spent_s += it.elapsed_s
        if tree.iterations:
            self._last_leaf = self.nodes[tree.iterations[-1].leaf]
        return self.nodes[0]

    def _most_visited(self, root: Node) -> Node:
        """The end of the most visited path of executed nodes (ties: the higher mean)."""
        node = root
        while True:
            done = [c for c in node.children if c.executed]
            if not done:
                return node
            node = max(done, key=lambda c: (c.visits, c.mean))

    def _finish(self, best: Node, reason: str, saved: bool = False) -> EpisodeEnd:
        """Save the search's end and write the chosen path as the episode's steps."""
        spec, path = self.ctx.spec, best.path()
        if not saved and self.agent.log is not None:
            self._save(None)
            end = SearchEnd(best_node=best.id, won=best.won, reason=reason)
            self.agent.log.end_search(spec.episode_id, end, [0, *(n.id for n in path)])
        steps = best.steps()
        for step in steps[len(spec.resume_steps) :]:
            self.ctx.record(step)
        if best.won:
            return EpisodeEnd(won=True)
        end_here = self.agent.actor.check_end(steps, False) if steps else None
        if end_here is not None:
            return replace(end_here, verdict=f"{end_here.verdict}; {_SEARCH}{reason}")
        verdict = f"{_SEARCH}{reason}"
        failure = classify_end(classify_failure(steps, None, False), verdict, SEARCH_ENDS)
        return EpisodeEnd(won=False, failure_class=failure.value, verdict=verdict)


class _Counted:
    """The context's model access, counting tokens toward the search's budget."""

    def __init__(self, search: _Search) -> None:
        self.search = search

    async def generate(self, request: Request) -> Completion:
        return await self.search._generate(request)


def _build(ctx: ArmContext) -> LatsAgent:
    return LatsAgent(ctx.actor, ctx.reflexion, ctx.settings, ctx.search_log, ctx.ground_truth)


ARMS = (
    Arm(
        "lats",
        _build,
        NO_MEMORY,
        "tree search (LATS)",
        section="lats",
        settings=LatsConfig,
        ends=ACTOR_ENDS + SEARCH_ENDS,
    ),
    Arm(
        "lats+reflexion",
        _build,
        REFLEXION,
        "tree search with reflections",
        section="lats",
        settings=LatsConfig,
        ends=ACTOR_ENDS + SEARCH_ENDS,
    ),
)
