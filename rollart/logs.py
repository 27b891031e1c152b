"""Logging set-up: structlog, one JSON object per line, bound with the node and its role.

Every daemon calls `configure_logging(node=..., role=...)` once at start; modules log through
`structlog.get_logger(name)` and bind what they know (session, peer, trajectory id) per call or
through `structlog.contextvars`. Standard-library loggers (aiohttp, asyncio) are routed through
the same renderer so a node's log file holds JSON lines only.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(
    *,
    node: str | None = None,
    role: str | None = None,
    level: str = "info",
    json: bool = True,
    stream: TextIO | None = None,
    cache: bool = True,
) -> None:
    """Route structlog and stdlib logging to `stream` (stderr) as JSON (or console) lines.

    `cache`: loggers keep this configuration from their first use (fast, for a node's process);
    False when it is temporary (the in-process simulation restores the caller's afterwards)."""
    stream = stream or sys.stderr
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=cache,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, structlog.processors.format_exc_info],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(_LEVELS[level], logging.INFO))
    structlog.contextvars.clear_contextvars()
    bound = {key: value for key, value in (("node", node), ("role", role)) if value is not None}
    structlog.contextvars.bind_contextvars(**bound)
