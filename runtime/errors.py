"""Errors a caller can fix; the engine stays usable after any of them."""

from __future__ import annotations


class RequestError(ValueError):
    """An invalid request (OpenAI's invalid_request_error): names the field and the fix."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request_error"):
        super().__init__(message)
        self.param = param
        self.code = code


class ContextWindowExceededError(RequestError):
    def __init__(self, message: str):
        super().__init__(message, param="messages", code="context_length_exceeded")
