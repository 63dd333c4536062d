"""`RequestError`: a bad request, naming the field that is wrong.

Its own module so that every part of the request side can raise it without importing the
validator (`validate.prepare` compiles a request's output constraint with `grammar.py`, which
raises it too).
"""

from __future__ import annotations


class RequestError(ValueError):
    """A bad request: `field` names what is wrong (e.g. "sampling.top_p")."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
