"""Orchestrator KV hints the vLLM adapter reads: vLLM's ``KvHintsEnvelope``
(``vllm/v1/kv_hints``), attached to a request by a router or an agent harness and handed
to the offloading manager as ``ReqContext.kv_hints`` (vLLM 0.31 to 0.34).

The envelope is versioned, and each action is defined by the component that executes it.
hybridstore executes one::

    {"action_id": "...", "action_type": "hybridstore.resume_in", "action_version": "1",
     "payload": {"seconds": 30.0}}          # or {"seconds": null}: the session is over

attached to a request: once that request's KV and state are stored, the session that
continues its prompt is expected back in ``seconds`` (an agent waiting on a tool call of
known length), or never (a task that ended, a closed conversation). The manager hands it
to :meth:`~hybridstore.HybridStore.expect` (``in_s``). Other actions are left to other
components; a malformed one of ours is logged and ignored: a hint never fails a request.
"""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger("hybridstore.adapters.vllm")

RESUME_IN = "hybridstore.resume_in"
"""The action type hybridstore executes (major version 1)."""


def resume_in(envelope: Any) -> float | None:
    """Seconds until the session continues (``math.inf``: never) from a request's
    ``KvHintsEnvelope``, or ``None`` when it carries no valid ``hybridstore.resume_in``."""
    for action in getattr(envelope, "actions", None) or ():
        if getattr(action, "action_type", None) != RESUME_IN:
            continue
        version = str(getattr(action, "action_version", ""))
        payload = getattr(action, "payload", None)
        seconds = payload.get("seconds", ...) if isinstance(payload, dict) else ...
        if version.split(".")[0] != "1" or seconds is ...:
            log.warning("hybridstore: ignoring a %s hint of version %r with payload %r "
                        "(expected version 1 and {\"seconds\": number or null})",
                        RESUME_IN, version, payload)
            continue
        if seconds is None:
            return math.inf
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                or not 0 <= seconds < math.inf:
            log.warning("hybridstore: ignoring a %s hint of %r seconds", RESUME_IN, seconds)
            continue
        return float(seconds)
    return None


__all__ = ["RESUME_IN", "resume_in"]
