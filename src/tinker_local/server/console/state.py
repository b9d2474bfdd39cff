"""What the console keeps besides the server's own state: the registered log directories and
the parsed metrics files. One per app (`app.state.console`), made by `install_console`."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from tinker_local.server.console.log_dirs import REGISTRY_FILE, LogDirRegistry, MetricsCache
from tinker_local.server.core.service import Service


@dataclass
class ConsoleState:
    registry: LogDirRegistry
    metrics: MetricsCache = field(default_factory=MetricsCache)

    @classmethod
    def for_service(cls, svc: Service) -> ConsoleState:
        database = svc.settings.database
        return cls(LogDirRegistry(database.parent / REGISTRY_FILE if database else None))


def console_state(request: Request) -> ConsoleState:
    return request.app.state.console
