"""The agent side: ReAct actor, evaluators, self-reflection, and model backends (agents.llm).

Imports ``memory`` only; never ``envs`` or ``experiments``.
"""
