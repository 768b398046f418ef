"""A test environment in the tiny model's arithmetic vocabulary, loaded by file path like a user's.

Each observation repeats the model's turn back (``"<turn>="``), so a test can rebuild every observation's
tokens from the sampled tokens alone; the episode ends after ``turns`` turns with reward 1 when some
turn contained a 7. Tasks with a ``fault`` (a share ``fault_rate`` of them) make the environment fail
on its second step: "raise", "hang" (past any deadline) or "die" (its worker process exits); "slow"
takes a second over its first step; "noisy" adds the clock's nanoseconds to each observation (an
environment that answers otherwise when replayed). ``EchoState`` is the same environment offering its
state (``Environment.state_dict``), so that a resume loads it instead of replaying.
"""

from __future__ import annotations

import os
import random
import time

from megagrpo.envs.base import Environment, Step


class Echo(Environment):
    def __init__(self, turns: int = 3, fault_rate: float = 0.0):
        self.turns = turns
        self.seen: list[str] = []
        self.fault = None

    @classmethod
    def tasks(cls, count: int, seed: int, turns: int = 3, fault_rate: float = 0.0) -> list[dict]:
        rng = random.Random(seed)
        modes = ["raise", "hang", "die"]
        out = []
        for _ in range(count):
            task = {"start": rng.randint(0, 99)}
            if rng.random() < fault_rate:
                task["fault"] = rng.choice(modes)
            out.append(task)
        return out

    def reset(self, task: dict) -> list[dict]:
        self.fault = task.get("fault")
        return [{"role": "user", "content": f"{task['start']}="}]

    def step(self, turn: str) -> Step:
        self.seen.append(turn)
        if self.fault == "slow" and len(self.seen) == 1:
            time.sleep(1.0)
        if self.fault in ("raise", "hang", "die") and len(self.seen) == 2:
            if self.fault == "raise":
                raise RuntimeError("the environment failed on purpose")
            if self.fault == "hang":
                time.sleep(3600)
            os._exit(3)
        if len(self.seen) >= self.turns:
            return Step(reward=float(any("7" in t for t in self.seen)), done=True)
        noise = f" {time.time_ns()}" if self.fault == "noisy" else ""
        return Step(messages=[{"role": "user", "content": f"{turn}={noise}"}])


class EchoState(Echo):
    def state_dict(self) -> dict:
        return {"seen": list(self.seen), "fault": self.fault}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.fault = list(state["seen"]), state["fault"]
