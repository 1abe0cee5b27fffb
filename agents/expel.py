"""Rules and retrieved trajectories together: the evaluation ExpeL runs on new tasks.

The ``expel`` arm is Reflexion with both kinds of a gathering run's experience: the rules in
scope above the prompt (:mod:`agents.insights`) and the most similar won trajectories as its
few-shot examples (:mod:`agents.retrieval`). A run of it needs ``experience_from``; the rules are
extracted on first use, as for ``insights``.
"""

from __future__ import annotations

from agents.arm import Arm
from agents.experience import ExperienceConfig
from agents.insights import with_rules
from agents.memory_policy import PastTrials, Recall, ReflexionWindow
from agents.react import build_react
from agents.reflexion import ReflexionSettings
from agents.retrieval import with_retrieved


class RulesAndRetrieval(ReflexionWindow):
    """Reflexion, with the rules in scope above the prompt and retrieved won trajectories as its
    few-shot examples."""

    uses_experience = "rules"  # a run of this arm needs experience_from, with its rules

    def recall(
        self, settings: ReflexionSettings, past: PastTrials, task: str, trial: int
    ) -> Recall:
        return with_retrieved(with_rules(super().recall(settings, past, task, trial), past), past)


EXPEL = RulesAndRetrieval()

ARMS = (
    Arm(
        "expel",
        build_react,
        EXPEL,
        "rules and retrieved trajectories",
        section="experience",
        settings=ExperienceConfig,
    ),
)
