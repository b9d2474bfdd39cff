"""Experiment tracking: Weights & Biases and TensorBoard, both optional extras.

    pip install -e ".[wandb]"         # W&B: set WANDB_API_KEY, or WANDB_MODE=offline
    pip install -e ".[tensorboard]"   # TensorBoard event files (tensorboardX, no TensorFlow)

A `Tracker` belongs to one log directory and mirrors the numbers a run already writes to its
JSONL logs (those stay the record; a tracker that is not asked for costs nothing).

- W&B: the run's id is kept in `<log_dir>/wandb_run.json`, so running the same command again
  (a resume) continues the same W&B run (`wandb.init(id=..., resume="allow")`); W&B's own files
  (an offline run's too) go to `<log_dir>/wandb/`. The run name defaults to the log directory's
  name. W&B never rewinds a run: rows of steps a resumed run redoes are kept from the first
  attempt, and W&B warns that it drops the repeats.
- TensorBoard: event files in `<log_dir>/tensorboard/` (`tensorboard --logdir runs/` shows every
  run under runs/). A resumed run purges the events of the steps it redoes (`purge_step`).

Asking for a tracker whose package is not installed is an error that names the extra, raised
before any training starts: a run never silently goes untracked.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

WANDB_RUN_FILE = "wandb_run.json"
TENSORBOARD_DIR = "tensorboard"


class TrackingUnavailable(ValueError):
    """A tracker was asked for, but its package is not installed (or it cannot start)."""


@dataclass(frozen=True)
class TrackingSettings:
    """What to track to. `wandb_group` gathers the runs of one pipeline's stages in W&B."""

    wandb_project: str | None = None
    wandb_name: str | None = None
    wandb_group: str | None = None
    tensorboard: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.wandb_project) or self.tensorboard


def check_available(settings: TrackingSettings) -> None:
    """Raise `TrackingUnavailable` now (before a server starts) if an asked-for tracker's
    package is missing."""
    if settings.wandb_project:
        _import_wandb()
    if settings.tensorboard:
        _import_summary_writer()


def wandb_run_id(log_dir: str | Path) -> str | None:
    """The W&B run id a log directory continues, if it has one."""
    path = Path(log_dir) / WANDB_RUN_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("id")


class Tracker:
    """W&B and/or TensorBoard for one log directory (see the module doc).

    `config`: the run's settings, shown by W&B; `job_type`: rl, sft, eval (W&B's filter);
    `resume_step`: the first step a resumed run logs again (TensorBoard forgets the events
    from there on); None for a fresh run."""

    def __init__(
        self,
        log_dir: str | Path,
        settings: TrackingSettings,
        *,
        config: Mapping[str, Any] | None = None,
        job_type: str | None = None,
        resume_step: int | None = None,
    ):
        self.dir = Path(log_dir)
        self.settings = settings
        self._wandb_run: Any = None
        self._tb: Any = None
        if not settings.enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        # Both imports first: a missing extra fails before either tracker has started.
        wandb = _import_wandb() if settings.wandb_project else None
        writer_class = _import_summary_writer() if settings.tensorboard else None
        if wandb is not None:
            self._wandb_run = self._start_wandb(wandb, dict(config or {}), job_type)
        if writer_class is not None:
            self._tb = writer_class(
                str(self.dir / TENSORBOARD_DIR),
                purge_step=resume_step or None,
                flush_secs=10,
            )

    @property
    def wandb_run(self) -> Any:
        """The live `wandb.Run`, or None."""
        return self._wandb_run

    def _start_wandb(self, wandb: Any, config: dict[str, Any], job_type: str | None) -> Any:
        s = self.settings
        path = self.dir / WANDB_RUN_FILE
        saved = json.loads(path.read_text()) if path.is_file() else {}
        run_id = saved.get("id") or _new_run_id()
        name = s.wandb_name or saved.get("name") or self.dir.resolve().name
        # Written before init: a run killed while W&B starts still resumes the same id.
        _write_json(path, {"id": run_id, "project": s.wandb_project, "name": name})
        if saved.get("project") and saved["project"] != s.wandb_project:
            logger.warning(
                "%s was tracked in W&B project %r; continuing run %s in %r",
                self.dir, saved["project"], run_id, s.wandb_project,
            )
        try:
            return wandb.init(
                project=s.wandb_project,
                name=name,
                id=run_id,
                resume="allow",
                dir=str(self.dir),
                group=s.wandb_group,
                job_type=job_type,
                config=config,
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as error:  # W&B raises many kinds; each means there is no run
            raise TrackingUnavailable(
                f"W&B could not start run {run_id} of project {s.wandb_project!r}: {error}. Log in "
                "(WANDB_API_KEY) or set WANDB_MODE=offline to keep the run on disk"
            ) from error

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        """The numbers among `values` (strings and other objects are the JSONL logs' alone)."""
        numbers = {
            k: float(v)
            for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
        }
        if not numbers:
            return
        if self._wandb_run is not None:
            self._wandb_run.log(numbers, step=step)
        if self._tb is not None:
            for key, value in numbers.items():
                if math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def summary(self, values: Mapping[str, Any]) -> None:
        """End-of-run numbers (W&B's run summary; TensorBoard gets them as text)."""
        if self._wandb_run is not None:
            self._wandb_run.summary.update(dict(values))
        if self._tb is not None:
            lines = [f"| {k} | {v} |" for k, v in values.items()]
            self._tb.add_text("summary", "\n".join(["| key | value |", "|---|---|", *lines]), 0)

    def table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """A table (W&B Table; TensorBoard text, as Markdown)."""
        if self._wandb_run is not None:
            import wandb

            data = [list(r) for r in rows]
            self._wandb_run.log({name: wandb.Table(columns=list(columns), data=data)})
        if self._tb is not None:
            head = "| " + " | ".join(columns) + " |"
            rule = "|" + "---|" * len(columns)
            body = ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
            self._tb.add_text(name, "\n".join([head, rule, *body]), 0)

    def close(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise TrackingUnavailable(
            'W&B tracking was asked for (--wandb-project) but wandb is not installed: '
            'pip install -e ".[wandb]" (or pip install wandb)'
        ) from None
    return wandb


def _import_summary_writer() -> Any:
    """tensorboardX's SummaryWriter (light: no TensorFlow, no grpc), else torch's (which needs
    the `tensorboard` package)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TrackingUnavailable(
                'TensorBoard logging was asked for (--tensorboard) but tensorboardX is not '
                'installed: pip install -e ".[tensorboard]" (or pip install tensorboardX)'
            ) from None
    return SummaryWriter


def _new_run_id() -> str:
    """Eight lowercase letters and digits, the shape of the ids W&B makes itself."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
