"""The text of TextWorld-PDDL games, derived exactly as TextWorld does, without repeating work.

TextWorld's ``ContextSensitiveGrammar.derive`` re-parses its start string with TatSu on every
call, deep-copies a derivation context for every symbol, and parses every rule condition and
query again each time it meets one. :class:`TextDeriver` gives the same strings:

- every string is parsed once, by TextWorld's own parser, and kept as an immutable tree (start
  strings and conditions are shared by all games; a game's rules are converted once per game);
- contexts are plain dicts that are never mutated, so they are shared instead of copied (the
  grammar only reads them);
- a derivation's text is memoized under its start string and action mapping, together with the
  state it read: the version of every fact signature its conditions and queries looked up
  (:func:`tracked_state_class` counts changes per signature). A later call reuses the text only
  while none of those signatures has changed, so the commands of actions whose text reads no
  state (``open drawer 1``) or only facts that never change (``go to cabinet 1``) are derived
  once per game.

Why it is exact: conditions and queries are answered by the state's own ``all_assignments`` (the
same facts, the same order); rules are chosen, lists joined and values turned into text as in
``textworld.envs.pddl.textgen``; ``{...}`` expressions are evaluated only when they are made of
names bound in the context, attribute reads, constants and ``+``/``or``/``and`` (what ALFWorld's
grammars use), which read nothing else. Anything else (another expression, an unknown symbol, no
applicable rule, any error) raises :class:`Unsupported`, and the caller derives that string with
TextWorld's own code instead.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import itertools
import logging
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# The derivation of one string: (start string, action mapping as a tuple of its items).
MemoKey = tuple[str, tuple[tuple[Any, Any], ...]]
# Symbol trees: tuples whose first item is the kind.
TERMINAL, NONTERMINAL, EVAL, CONDITIONAL, LIST = range(5)
# Names that TextWorld's eval resolves to its own locals, whatever the context binds.
_SHADOWED = frozenset({"self", "context", "value"})
_SAFE_NODES = (
    ast.Expression,
    ast.Name,
    ast.Load,
    ast.Attribute,
    ast.Constant,
    ast.BinOp,
    ast.Add,
    ast.BoolOp,
    ast.Or,
    ast.And,
)
_NO_BUILTINS: dict[str, Any] = {"__builtins__": {}}
_MISSING = object()
_VERSIONS = itertools.count(1)
log = logging.getLogger(__name__)


class Unsupported(Exception):
    """This string must be derived by TextWorld's own code (or fails there as it fails here)."""


def new_version() -> int:
    """A number never handed out before: names the content of a fact set (or a whole state)."""
    return next(_VERSIONS)


class RecordingState:
    """Mixin for ``PddlState``: keeps the facts its constructor adds, so it can be rebuilt.

    ``PddlState.__init__`` translates the problem with fast-downward (twice), loads the SAS and
    then adds two lists of facts; :func:`restore_state` replays that without the translation.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._added: list[list[Any]] = []
        super().__init__(*args, **kwargs)

    def add_facts(self, props: Iterable[Any]) -> None:
        props = list(props)
        self._added.append(props)
        super().add_facts(props)  # type: ignore[misc]


@functools.cache
def recording_state_class() -> type:
    """TextWorld's ``PddlState`` with :class:`RecordingState` (nothing else changed)."""
    # heavy: textworld, only to play or make a game
    from textworld.envs.pddl import logic as pddl_logic

    class RecordingPddlState(RecordingState, pddl_logic.PddlState):  # type: ignore[misc,valid-type]
        pass

    return RecordingPddlState


@functools.cache
def tracked_state_class() -> type:
    """A recording ``PddlState`` that counts changes per fact signature and records its reads.

    ``versions[sig]`` changes whenever the set of facts with signature ``sig`` changes; a
    signature absent from ``versions`` still has the content it had when the state was built,
    named by ``epoch`` (states built from one translation share it). While ``reads`` is a set,
    every signature looked up is added to it; a lookup by variable type (conjunctive queries never
    make one) adds ``None``: not memoizable. Everything else is TextWorld's ``PddlState``.
    """

    class TrackedPddlState(recording_state_class()):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.versions: dict[Any, int] = {}
            self.reads: set[Any] | None = None
            super().__init__(*args, **kwargs)
            self.settle(new_version())

        def settle(self, epoch: int) -> None:
            """Name the current content ``epoch``: every signature unchanged since."""
            self.versions = {}
            self.epoch = epoch

        def add_fact(self, prop: Any) -> None:
            if prop not in self._facts.get(prop.signature, ()):
                self.versions[prop.signature] = new_version()
            super().add_fact(prop)

        def remove_fact(self, prop: Any) -> None:
            if prop in self._facts.get(prop.signature, ()):
                self.versions[prop.signature] = new_version()
            super().remove_fact(prop)

        def facts_with_signature(self, sig: Any) -> Any:
            if self.reads is not None:
                self.reads.add(sig)
            return super().facts_with_signature(sig)

        def variables_of_type(self, type: str) -> Any:
            if self.reads is not None:
                self.reads.add(None)
            return super().variables_of_type(type)

    return TrackedPddlState


# What PddlState.__init__ computes from a problem before adding its facts: the translation.
_TRANSLATED = (
    "_logic",
    "downward_lib",
    "pddl_problem",
    "task",
    "sas",
    "sas_replan",
    "_actions",
    "name2type",
)


@dataclass(frozen=True)
class Translation:
    """What ``PddlState.__init__`` computed for one problem: enough to rebuild that state.

    ``attributes`` are the state's attributes that hold the translation, ``added`` the fact
    lists its constructor added, in order; ``epoch`` names the content of states built from it
    (for tracked states; 0 otherwise).
    """

    attributes: dict[str, Any]
    added: tuple[list[Any], ...]
    epoch: int

    @classmethod
    def of(cls, state: Any) -> Translation:
        """The translation a just-built recording state holds (before it is played)."""
        attributes = {name: getattr(state, name) for name in _TRANSLATED}
        return cls(attributes, tuple(state._added), getattr(state, "epoch", 0))

    def stored(self) -> dict[str, Any]:
        """The translation as plain data (texts and names), for another process to rebuild with
        :meth:`from_stored`: the SAS texts and the facts the state started with. The rest is
        cheap to compute again; objects are not stored: TextWorld's and fast-downward's keep
        their hashes, which differ from one process to the next."""
        return {
            "pddl_problem": self.attributes["pddl_problem"],
            "sas": self.attributes["sas"],
            "sas_replan": self.attributes["sas_replan"],
            "added": [
                [[p.name, [[v.name, v.type] for v in p.arguments]] for p in props]
                for props in self.added
            ],
        }

    @classmethod
    def from_stored(cls, entry: Mapping[str, Any], logic: Any) -> Translation:
        """The translation :meth:`stored` gave, for this process's freshly parsed ``logic``, as
        ``PddlState.__init__`` computes it: fast-downward's task parsed and normalized by
        fast-downward (the translator's first steps, a few milliseconds), the task's types added
        to ``logic``, its actions and object types looked up by name; the SAS texts and the
        starting facts from the entry. Its states get a content name of their own."""
        # heavy: textworld, only to play or make a game
        from textworld.logic import Proposition, Type, Variable

        problem = entry["pddl_problem"]
        task = parse_task(logic.domain, problem)
        for type_ in task.types:
            try:
                logic.types.add(Type(type_.name, type_.supertype_names))
            except ValueError:  # already there
                pass
        attributes = {
            "_logic": logic,
            "downward_lib": None,  # restore_state sets the engine's own
            "pddl_problem": problem,
            "task": task,
            "sas": entry["sas"],
            "sas_replan": entry["sas_replan"],
            "_actions": {a.name: a for a in task.actions},
            "name2type": {o.name: o.type_name for o in task.objects},
        }
        added = tuple(
            [Proposition(name, [Variable(v, t) for v, t in args]) for name, args in props]
            for props in entry["added"]
        )
        return cls(attributes, added, new_version())


def parse_task(domain: str, problem: str) -> Any:
    """fast-downward's task for a PDDL domain and problem, parsed and normalized by
    fast-downward's own code as ``pddl2sas`` does before it translates (its warnings are
    swallowed, as there)."""
    # fast-downward's translator reads its options from sys.argv when first imported, and its
    # pddl2sas sets sys.argv for it; do the same, and put it back
    saved = sys.argv
    if "fast_downward.translate.options" not in sys.modules:
        sys.argv = ["translate.py", "domain", "task"]
    try:
        # heavy: fast-downward's translator, only to play a game
        from fast_downward.translate import normalize
        from fast_downward.translate.pddl_parser import lisp_parser, parsing_functions
    finally:
        sys.argv = saved
    with contextlib.redirect_stdout(io.StringIO()):
        task = parsing_functions.parse_task(
            lisp_parser.parse_nested_list(domain.split("\n")),
            lisp_parser.parse_nested_list(problem.split("\n")),
        )
        normalize.normalize(task)
    return task


def restore_state(cls: Any, translation: Translation, downward_lib: Any) -> Any:
    """A new ``cls`` state equal to a freshly translated one, without translating.

    Sets the attributes ``PddlState.__init__`` sets, from the translation, loads the same SAS
    into fast-downward (``downward_lib``: the engine's own, which need not be the one that
    translated) and adds the same facts in the same order: equal data, equal iteration orders.
    A tracked state gets the translation's ``epoch``: its content is the first one's.
    """

    state = cls.__new__(cls)
    state._added = []
    state.versions, state.reads = {}, None
    state._facts = defaultdict(set)
    state._vars_by_name = {}
    state._vars_by_type = defaultdict(set)
    state._var_counts = Counter()
    for name, value in translation.attributes.items():
        setattr(state, name, value)
    state.downward_lib = downward_lib
    state.downward_lib.load_sas(state.sas.encode("utf-8"))
    state.downward_lib.load_sas_replan(state.sas_replan.encode("utf-8"))
    for props in translation.added:
        state.add_facts(props)
    if issubclass(cls, tracked_state_class()):
        state.settle(translation.epoch)
    else:
        del state.versions, state.reads
    return state


@functools.lru_cache(maxsize=4096)
def parse_symbols(text: str) -> tuple[Any, ...]:
    """A start string parsed once by TextWorld's own grammar parser."""
    from textworld.envs.pddl import textgen  # heavy: textworld, only to play or make a game

    return tuple(convert(s) for s in textgen._parse_and_convert(text, rule_name="symbols"))


@functools.lru_cache(maxsize=4096)
def parse_query(text: str) -> Any:
    """A condition or query parsed once: TextWorld's ``Rule.parse_conjunctive_query``."""
    from textworld.logic import Rule  # heavy: textworld, only to play or make a game

    return Rule.parse_conjunctive_query(text)


@functools.lru_cache(maxsize=4096)
def compile_expression(expression: str) -> tuple[Any, frozenset[str]] | None:
    """``(code, names)`` for an expression this module can evaluate exactly, else ``None``."""
    source = expression.lstrip(" \t")  # as eval() strips a string before compiling it
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        return None
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, _SAFE_NODES):
            return None
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            return None
        if isinstance(node, ast.Name):
            names.add(node.id)
    if names & _SHADOWED:
        return None
    return compile(source, "<string>", "eval", dont_inherit=True), frozenset(names)


def convert(symbol: Any) -> tuple[Any, ...]:
    """TextWorld's symbol object (textgen.Symbol) as an immutable tuple tree."""
    kind = type(symbol).__name__
    if kind == "TerminalSymbol":
        return (TERMINAL, symbol.symbol)
    if kind == "NonterminalSymbol":
        return (NONTERMINAL, str(symbol))
    if kind == "EvalSymbol":
        return (EVAL, compile_expression(symbol.expression))
    if kind == "ConditionalSymbol":
        query = parse_query(symbol.given) if symbol.given else None
        return (CONDITIONAL, convert(symbol.expression), query)
    if kind == "ListSymbol":
        return (LIST, convert(symbol.symbol))
    raise Unsupported(f"unknown symbol {symbol!r}")


class FastGrammar:
    """A game's ``ContextSensitiveGrammar`` whose ``derive`` gives the same text, faster.

    TextWorld's env code calls ``grammar.derive(start, context)`` with a context it builds from
    an action's mapping; when the context is that (its variables are the entities the mapping
    names, its state a :func:`tracked_state_class` state) the text comes from a
    :class:`TextDeriver`, otherwise (and for whatever that raises :class:`Unsupported` for, or
    when TextWorld's grammar tracing flags are set) from the grammar itself.
    """

    def __init__(self, grammar: Any, entity_infos: Mapping[str, Any], memo_size: int = 8192):
        self.grammar = grammar
        self.entity_infos = entity_infos
        self.deriver = TextDeriver(grammar, entity_infos, memo_size)
        self.fallbacks = 0

    def derive(self, start: str, context: Mapping[str, Any] | None = None) -> str:
        context = context or {}
        state, mapping = context.get("state"), context.get("mapping")
        if (
            hasattr(state, "versions")
            and isinstance(mapping, dict)
            and self._bound_as_usual(context, mapping)
            and not (os.environ.get("TW_CSG_TRACE") or os.environ.get("TW_CSG_DEBUG"))
        ):
            try:
                return self.deriver.derive(start, state, mapping)
            except Unsupported as exc:
                log.debug("deriving %r with TextWorld's grammar: %s", start, exc)
        self.fallbacks += 1
        return self.grammar.derive(start, context)  # type: ignore[no-any-return]

    def _bound_as_usual(self, context: Mapping[str, Any], mapping: dict[Any, Any]) -> bool:
        """Whether the context's variables are exactly the entities its mapping names."""
        infos, variables = self.entity_infos, context.get("variables")
        if context.get("entity_infos") is not infos or not isinstance(variables, dict):
            return False
        if len(variables) != len(mapping):
            return False
        for ph, var in mapping.items():
            if variables.get(ph.name, _MISSING) is not infos.get(var.name):
                return False
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grammar, name)


class TextDeriver:
    """Derives a game's text from its grammar as ``ContextSensitiveGrammar.derive`` does.

    One per game: ``grammar`` is the game's ``ContextSensitiveGrammar`` and ``entity_infos`` its
    entities (their names must not change while the deriver is in use). ``memo_size`` bounds the
    memoized derivations (the oldest go first).
    """

    def __init__(self, grammar: Any, entity_infos: Mapping[str, Any], memo_size: int):
        self._grammar_rules = grammar._rules
        self._infos = entity_infos
        self._rules: dict[str, tuple[tuple[Any, tuple[Any, ...]], ...] | None] = {}
        self._memo: dict[MemoKey, tuple[str, tuple[tuple[Any, int], ...]]] = {}
        self._memo_size = memo_size
        self.hits = 0
        self.misses = 0

    def derive(self, start: str, state: Any, mapping: Mapping[Any, Any]) -> str:
        """The text for ``start`` in the context of ``mapping`` (variables: the entities it
        names) in ``state``, a :func:`tracked_state_class` state. Raises :class:`Unsupported`."""
        key = (start, tuple(mapping.items()))
        hit = self._memo.get(key)
        versions, epoch = state.versions, state.epoch
        if hit is not None and all(versions.get(sig, epoch) == v for sig, v in hit[1]):
            self.hits += 1
            return hit[0]
        self.misses += 1
        reads: set[Any] = set()
        state.reads = reads
        try:
            variables = {ph.name: self._infos[var.name] for ph, var in mapping.items()}
            out: list[Any] = []
            self._expand(parse_symbols(start), state, dict(mapping), variables, out)
            text = "".join(map(str, out))
        except Unsupported:
            raise
        except Exception as exc:  # TextWorld's own code gives (or raises) what is right here
            raise Unsupported(f"{exc.__class__.__name__}: {exc}") from exc
        finally:
            state.reads = None
        if None not in reads:
            if len(self._memo) >= self._memo_size:
                del self._memo[next(iter(self._memo))]
            self._memo[key] = (text, tuple((sig, versions.get(sig, epoch)) for sig in reads))
        return text

    # -- the grammar, applied as textgen.ContextSensitiveGrammar.derive applies it -------------
    def _expand(
        self,
        symbols: Iterable[Any],
        state: Any,
        mapping: dict[Any, Any],
        variables: dict[str, Any],
        out: list[Any],
    ) -> None:
        """Append the text of ``symbols`` to ``out`` (TextWorld's derivation stack, unrolled)."""
        for symbol in symbols:
            kind = symbol[0]
            if kind == TERMINAL:
                out.append(symbol[1])
            elif kind == NONTERMINAL:
                self._expand(
                    self._choose(symbol[1], state, mapping), state, mapping, variables, out
                )
            elif kind == EVAL:
                out.append(self._eval(symbol, variables))
            elif kind == CONDITIONAL:
                for m, v in self._contexts(symbol[2], state, mapping, variables):
                    self._expand((symbol[1],), state, m, v, out)
            else:  # LIST: textgen.display_list over the items of its symbol
                items = self._items(symbol[1], state, mapping, variables)
                if not items:
                    self._expand(((NONTERMINAL, "list_empty"),), state, mapping, variables, out)
                for i, (item, m, v) in enumerate(items):
                    if i:
                        sep = "list_last_separator" if i == len(items) - 1 else "list_separator"
                        self._expand(((NONTERMINAL, sep),), state, mapping, variables, out)
                    self._expand((item,), state, m, v, out)

    def _items(
        self, symbol: Any, state: Any, mapping: dict[Any, Any], variables: dict[str, Any]
    ) -> list[tuple[Any, dict[Any, Any], dict[str, Any]]]:
        if symbol[0] == CONDITIONAL:
            contexts = self._contexts(symbol[2], state, mapping, variables)
            return [(symbol[1], m, v) for m, v in contexts]
        if symbol[0] == EVAL:
            return [((TERMINAL, self._eval(symbol, variables)), mapping, variables)]
        raise Unsupported("a list of something other than {...}")

    def _choose(self, name: str, state: Any, mapping: dict[Any, Any]) -> tuple[Any, ...]:
        """The right-hand side of the first rule for ``name`` whose condition holds."""
        if name not in self._rules:
            self._rules[name] = self._convert_rules(name, state)
        rules = self._rules[name]
        if rules is None:
            raise Unsupported(f"#{name}# has no rules or a condition TextWorld cannot answer")
        for condition, rhs in rules:
            if condition is None:
                return rhs
            for _ in state.all_assignments(condition, mapping):
                return rhs
        raise Unsupported(f"no applicable rule for #{name}#")

    def _convert_rules(
        self, name: str, state: Any
    ) -> tuple[tuple[Any, tuple[Any, ...]], ...] | None:
        """The rules for ``name`` as (condition, symbols); ``None`` when TextWorld would fail.

        TextWorld checks the conditions of all the rules, this deriver only up to the first that
        holds: a condition naming an unknown type (the one way a check fails) makes it refuse.
        """
        raw = self._grammar_rules.get(name)
        if not raw:
            return None
        rules = []
        for rule in raw:
            condition = parse_query(rule.condition) if rule.condition else None
            if condition is not None:
                for pred in condition.preconditions:
                    for type_name in pred.signature.types:
                        try:
                            state._logic.types.get(type_name)
                        except KeyError:
                            return None
            rules.append((condition, tuple(map(convert, rule.rhs))))
        return tuple(rules)

    def _contexts(
        self, query: Any, state: Any, mapping: dict[Any, Any], variables: dict[str, Any]
    ) -> list[tuple[dict[Any, Any], dict[str, Any]]]:
        """textgen.query: one context per assignment of the query, in the state's order."""
        if query is None:
            return [(mapping, variables)]
        contexts = []
        for found in state.all_assignments(query, mapping):
            v = dict(variables)
            v.update({ph.name: self._infos[var.name] for ph, var in found.items()})
            m = dict(mapping)
            m.update(found)
            contexts.append((m, v))
        return contexts

    @staticmethod
    def _eval(symbol: Any, variables: dict[str, Any]) -> Any:
        compiled = symbol[1]
        if compiled is None or not compiled[1] <= variables.keys():
            raise Unsupported("an expression only TextWorld's eval can evaluate")
        return eval(compiled[0], _NO_BUILTINS, variables)
