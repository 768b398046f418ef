"""The faults that stop a run, and the exit status that asks for it to be resumed.

A ``RunFault`` names what failed (a policy rank and its node, an engine and its last error);
``megagrpo train`` exits with ``FAULT_EXIT`` on one, which the supervisor in ``launch/`` answers with a
relaunch under ``--resume``.
"""

from __future__ import annotations

# Exit status of a run stopped by a fault that ``--resume`` continues from (EX_TEMPFAIL).
FAULT_EXIT = 75


class RunFault(RuntimeError):
    """A fault that stopped the run (a policy rank lost, engines failing past their restarts);
    the latest checkpoint continues it (``--resume``)."""


class RankFailure(RunFault):
    """A rank of a RankGroup died or did not answer in time; the message names it and its node."""


class EngineFailure(RunFault):
    """An engine failed once more than ``generation.max_engine_restarts`` allow."""

    def __init__(self, message: str, engine: int):
        super().__init__(message)
        self.engine = engine


def first_line(err: BaseException) -> str:
    """An error's message without the traceback Ray appends."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
