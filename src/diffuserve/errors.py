"""The error types every layer raises; the server maps each one to exactly one HTTP answer.

Errors are raised at the edge with the offending value and the fix, so the message can be shown
to the user as is.
"""

from __future__ import annotations


class DiffuserveError(Exception):
    """Base class. `http_status`, `error_type` and `code` feed the OpenAI error envelope."""

    http_status = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequestError(DiffuserveError):
    """A request field is invalid; `param` names the field."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_value"


class ModelNotFoundError(DiffuserveError):
    http_status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class NotFoundError(DiffuserveError):
    http_status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class QueueFullError(DiffuserveError):
    """Admission control: the queue is at --max-queue-size. Sent with Retry-After."""

    http_status = 429
    error_type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, message: str, *, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServiceUnavailableError(DiffuserveError):
    """Not ready yet (loading/warm-up) or draining on shutdown."""

    http_status = 503
    error_type = "server_error"
    code = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(DiffuserveError):
    http_status = 504
    error_type = "server_error"
    code = "timeout"


class RequestCancelledError(DiffuserveError):
    """The client went away or cancelled; nobody reads this answer but it still closes the request."""

    http_status = 499
    error_type = "cancelled"  # the client's own doing, not a server fault (a cancelled video job shows this)
    code = "cancelled"


class GenerationError(DiffuserveError):
    """The pipeline raised while running a batch; every request of that batch gets this."""

    http_status = 500
    error_type = "server_error"
    code = "generation_failed"


class ConfigError(DiffuserveError):
    """A start-up configuration problem (flag, config file, checkpoint). Names the flag or file."""

    http_status = 500
    error_type = "server_error"
    code = "config_error"


class CheckpointError(ConfigError):
    """A checkpoint folder is missing a part or has an invalid one."""

    code = "checkpoint_error"
