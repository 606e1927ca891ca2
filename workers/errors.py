"""What a worker's refusal means, the same on its HTTP routes and its links: (exception, status, code), the
codes OpenAI-style strings. The first class in the list that an exception is an instance of decides."""

from __future__ import annotations

from edgespec.model.kv_cache import KVCacheError
from edgespec.model.kv_pool import CapacityError
from edgespec.model.stage import SessionError, StepError
from edgespec.workers.host import AssignmentError, NotAssignedError
from edgespec.workers.wire import WireError

ERRORS = [(PermissionError, 401, "invalid_cluster_token"), (WireError, 400, "invalid_body"),
          (KVCacheError, 400, "invalid_value"), (SessionError, 404, "session_not_found"),
          (StepError, 409, "stale_step"), (NotAssignedError, 409, "not_assigned"),
          (AssignmentError, 409, "wrong_assignment"), (CapacityError, 507, "kv_cache_full"),
          (MemoryError, 507, "out_of_memory"), (FileNotFoundError, 400, "model_not_found"),
          (ConnectionError, 502, "next_stage_unreachable"), (ValueError, 400, "invalid_value")]


def classify(exc: BaseException) -> tuple[int, str]:
    """(status, code) of a refusal; an unexpected fault is (500, "internal_error")."""
    for kind, status, code in ERRORS:
        if isinstance(exc, kind):
            return status, code
    return 500, "internal_error"
