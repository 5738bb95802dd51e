"""When a failed webhook delivery is tried again (pure): exponential backoff over a few tries, and
only for what may pass later (no answer, a timeout, 5xx, 408, 429); another 4xx is final."""
from __future__ import annotations

RETRY_STATUSES = frozenset({408, 425, 429})


def succeeded(status: int | None) -> bool:
    return status is not None and 200 <= status < 300


def retryable(status: int | None) -> bool:
    """`status` None: no HTTP answer (refused, timed out, reset, a disallowed address now)."""
    return status is None or status >= 500 or status in RETRY_STATUSES


def next_delay(tries: int, *, max_tries: int, base_s: float) -> float | None:
    """Seconds until the next try after `tries` failed ones: base, 2 base, 4 base ...; None when
    `max_tries` are spent."""
    if tries >= max_tries:
        return None
    return base_s * 2 ** (tries - 1)
