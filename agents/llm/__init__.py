"""Model backends behind one interface: ``make_backend(spec, **options).generate(requests)``.

Importing this package is light: every third-party model library is imported by the one module
that adapts it, when a backend is built.
"""

from agents.llm.base import (
    Backend,
    BackendError,
    CallSite,
    Completion,
    GenerationConfig,
    Message,
    MissingDependencyError,
    Request,
    SpecError,
)
from agents.llm.specs import ModelSpec, make_backend, parse_spec

__all__ = [
    "Backend",
    "BackendError",
    "CallSite",
    "Completion",
    "GenerationConfig",
    "Message",
    "MissingDependencyError",
    "ModelSpec",
    "Request",
    "SpecError",
    "make_backend",
    "parse_spec",
]
