"""Why the engine could not serve a request, other than the request's own input (that is a
ValueError): what AsyncEngine raises and the server maps to its HTTP answers
(kdaserve/server/errors.py)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine could not serve a request for a reason other than the request's input."""


class EngineStartupError(EngineError):
    """The engine process failed to load the model (the message is the child's error)."""


class EngineDeadError(EngineError):
    """The engine process is gone; no request can be served any more."""


class QueueFullError(EngineError):
    """Too many sequences (or prompt tokens) are waiting for their first token; try again
    later."""


class RequestTimeoutError(EngineError):
    """The request ran past its server-side deadline and was aborted."""
