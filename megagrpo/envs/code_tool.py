"""Tool-integrated math reasoning: the model may call a Python tool, which runs its code in the sandbox
(``megagrpo.envs.sandbox``) and answers with what it printed; its final answer (a turn without a tool
call) is scored by the math reward.

    system: the tool and how to call it (in ``env.tool_format``)   user: the question
    assistant: <tool_call>{"name": "python", "arguments": {"code": "print(37 * 45)"}}</tool_call>
    tool: 1665
    assistant: 1665                                                 -> reward 1, done

A malformed call (bad JSON, an unknown tool, no ``code``) is answered with a tool message saying what
is wrong, which the policy can learn from; it is counted in ``episode/tool_errors_mean``, as is code
that fails or is cut at its limits. Without a dataset the environment makes its own questions
(:meth:`PythonTool.tasks`: products and sums of two two-digit numbers, which a small model gets wrong
by heart more often than through the tool).
"""

from __future__ import annotations

import random

from megagrpo.envs.base import ArgumentError, Environment, Step
from megagrpo.envs.chat import ToolCall, format_tool_call, parse_tool_calls, tool_result_messages
from megagrpo.envs.sandbox import SandboxLimits, run_python

__all__ = ["PythonTool", "tool_use_records"]

_REWARDS = ("arithmetic", "math_verify")


class PythonTool(Environment):
    """``env.args``: ``reward`` ("arithmetic" or "math_verify"), ``question_key`` and ``answer_key`` (the
    task's fields), ``system_prompt`` (show the tool and its call format), and the sandbox's limits of each
    run of the model's code (``megagrpo.envs.sandbox.SandboxLimits``): ``cpu_s``, ``wall_s``, ``memory_mb``
    (per process), ``max_processes`` (a run holds at most ``max_processes`` x ``memory_mb``) and
    ``max_file_mb`` (each of its tmpfs /sandbox and /tmp)."""

    settings = ("tool_format", "allow_unsandboxed")
    runs_code = True

    def __init__(
        self,
        *,
        reward: str = "arithmetic",
        question_key: str = "question",
        answer_key: str = "answer",
        cpu_s: int = SandboxLimits.cpu_s,
        wall_s: float = SandboxLimits.wall_s,
        memory_mb: int = SandboxLimits.memory_mb,
        max_processes: int = SandboxLimits.max_processes,
        max_file_mb: int = SandboxLimits.max_file_mb,
        system_prompt: bool = True,
        tool_format: str = "hermes",
        allow_unsandboxed: bool = False,
    ):
        if reward not in _REWARDS:
            raise ArgumentError("reward", f"must be one of {', '.join(_REWARDS)}, got {reward!r}")
        self.reward, self.question_key, self.answer_key = reward, question_key, answer_key
        self.limits = SandboxLimits(
            cpu_s=cpu_s,
            wall_s=wall_s,
            memory_mb=memory_mb,
            max_processes=max_processes,
            max_file_mb=max_file_mb,
        )
        self.system_prompt, self.tool_format, self.allow_unsandboxed = (
            system_prompt,
            tool_format,
            allow_unsandboxed,
        )
        self.answer = ""

    @classmethod
    def check_args(cls, **args) -> None:
        cls(**args)  # the constructor checks them and does nothing else

    @classmethod
    def tasks(cls, count: int, seed: int, **_) -> list[dict]:
        rng = random.Random(seed)
        out = []
        for _ in range(count):
            a, b = rng.randint(12, 99), rng.randint(12, 99)
            op = rng.choice("*+")
            out.append({"question": f"{a}{op}{b}", "answer": str(a * b if op == "*" else a + b)})
        return out

    def reset(self, task: dict) -> list[dict]:
        for key in (self.question_key, self.answer_key):
            if key not in task:
                raise ValueError(f"PythonTool task has no {key!r} (keys: {sorted(task)})")
        self.answer = str(task[self.answer_key])
        question = {"role": "user", "content": str(task[self.question_key])}
        if not self.system_prompt:
            return [question]
        example = format_tool_call(ToolCall("python", {"code": "print(2 + 2)"}), self.tool_format)
        system = (
            "You can run Python code: call the tool python with the code to run, e.g. "
            f"{example}; it answers with what the code printed. When you know the answer, reply with it "
            "alone."
        )
        return [{"role": "system", "content": system}, question]

    def step(self, turn: str) -> Step:
        parsed = parse_tool_calls(turn, self.tool_format)
        if not parsed.calls and not parsed.errors:  # the final answer
            return Step(reward=self._score(turn), done=True)
        results, errors = list(parsed.errors), len(parsed.errors)
        for call in parsed.calls:
            code = call.arguments.get("code")
            if call.name != "python" or not isinstance(code, str):
                errors += 1
                results.append(
                    f'error: the only tool is python, called with {{"code": "..."}}; got {call.name!r} '
                    f"with arguments {sorted(call.arguments)}"
                )
                continue
            out = run_python(code, self.limits, allow_unsandboxed=self.allow_unsandboxed)
            errors += out.exit_code != 0 or out.timed_out
            results.append(out.summary() or "(no output)")
        calls = len(parsed.calls) + len(parsed.errors)
        return Step(tool_result_messages(results, self.tool_format), tool_calls=calls, tool_errors=errors)

    def state_dict(self) -> dict:
        """The answer is all an episode changes (the tool's runs keep nothing between calls), so a
        resumed episode continues whatever its code printed."""
        return {"answer": self.answer}

    def load_state_dict(self, state: dict) -> None:
        self.answer = str(state["answer"])

    def _score(self, text: str) -> float:
        if self.reward == "arithmetic":
            from megagrpo.rewards.arithmetic import arithmetic_reward

            return arithmetic_reward(text, self.answer)
        from megagrpo.rewards.math import math_verify_reward

        return math_verify_reward(text, self.answer)


def tool_use_records(count: int, seed: int, tool_frac: float, tool_format: str = "hermes") -> list[dict]:
    """SFT conversations on :meth:`PythonTool.tasks` questions (no system prompt, as the agent demo runs
    it): a share ``tool_frac`` call the python tool with the question as code, read its output (what the
    sandbox prints for it) and answer with it; the others answer at once (correctly: a small model learns
    the products by heart badly, so answering at once is often wrong when it samples). A model made from
    them uses the tool sometimes, and GRPO has a behaviour to reinforce."""
    rng = random.Random(seed)
    records = []
    for task in PythonTool.tasks(count, seed):
        question, answer = task["question"], task["answer"]
        messages = [{"role": "user", "content": question}]
        if rng.random() < tool_frac:
            call = format_tool_call(ToolCall("python", {"code": f"print({question})"}), tool_format)
            messages += [
                {"role": "assistant", "content": call},
                *tool_result_messages([answer], tool_format),
            ]
        messages.append({"role": "assistant", "content": answer})
        records.append({"messages": messages})
    return records
