"""The python tool environment (``megagrpo.envs.code_tool``) with the real sandbox: a call runs and its
output comes back as a tool message, malformed and unknown calls come back as error observations (never
exceptions), the final answer is scored, code that fails or hangs is reported and counted; the config
refuses it without a sandbox unless ``env.allow_unsandboxed``; the demo's SFT conversations."""

from __future__ import annotations

import pytest

from megagrpo.config import ConfigError, load_config
from megagrpo.envs.chat import ToolCall, format_tool_call, parse_tool_calls
from megagrpo.envs.code_tool import PythonTool, tool_use_records

pytestmark = pytest.mark.unit

FITS = ["env.environment=python_tool", "env.max_episode_tokens=128", "env.max_new_tokens=16"]


def _call(code: str, fmt: str = "hermes") -> str:
    return format_tool_call(ToolCall("python", {"code": code}), fmt)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_a_tool_call_runs_and_the_answer_is_scored(fmt):
    env = PythonTool(tool_format=fmt)
    opening = env.reset({"question": "537*42", "answer": "22554"})
    assert opening[-1] == {"role": "user", "content": "537*42"}
    assert _call("print(2 + 2)", fmt) in opening[0]["content"]  # the system prompt shows the format
    step = env.step(_call("print(537 * 42)", fmt))
    assert not step.done and step.tool_calls == 1 and step.tool_errors == 0
    assert step.messages == [{"role": "tool", "content": "22554"}]
    assert env.step("22554").reward == 1.0
    assert env.step("22555").reward == 0.0


def test_malformed_and_failing_calls_are_observations_the_policy_can_read():
    env = PythonTool(system_prompt=False, wall_s=2.0, cpu_s=1)
    assert env.reset({"question": "1+1", "answer": "2"}) == [{"role": "user", "content": "1+1"}]
    bad_json = env.step('<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"\n</tool_call>')
    assert bad_json.tool_errors == 1 and "not valid JSON" in bad_json.messages[0]["content"]
    unknown = env.step(format_tool_call(ToolCall("shell", {"cmd": "ls"}), "hermes"))
    assert unknown.tool_errors == 1 and "the only tool is python" in unknown.messages[0]["content"]
    raised = env.step(_call("raise ValueError('boom')"))
    assert raised.tool_errors == 1 and "ValueError: boom" in raised.messages[0]["content"]
    looped = env.step(_call("while True: pass"))
    assert looped.tool_errors == 1 and "killed" in looped.messages[0]["content"]
    silent = env.step(_call("x = 1"))
    assert silent.tool_errors == 0 and silent.messages[0]["content"] == "(no output)"
    assert not any(s.done for s in (bad_json, unknown, raised, looped, silent))


def test_config_wants_the_sandbox_or_allow_unsandboxed(monkeypatch):
    from megagrpo.envs import sandbox

    assert load_config(None, FITS).env.spec == "megagrpo.envs.code_tool:PythonTool"
    monkeypatch.setattr(sandbox, "sandbox_problem", lambda: "bwrap (bubblewrap) is not on PATH")
    with pytest.raises(ConfigError, match=r"env\.allow_unsandboxed.*bubblewrap"):
        load_config(None, FITS)
    assert load_config(None, [*FITS, "env.allow_unsandboxed=true"]).env.allow_unsandboxed


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("memroy_mb=256", "env.args.memroy_mb: PythonTool takes no such argument; did you mean 'memory_mb'?"),
        ("memory_mb=0", "env.args.memory_mb: must be an integer > 0, got 0"),
        ("max_processes=2.5", "env.args.max_processes: must be an integer > 0, got 2.5"),
        ("max_file_mb=-1", "env.args.max_file_mb: must be an integer > 0, got -1"),
        ("wall_s=0", "env.args.wall_s: must be a number > 0, got 0"),
        ("reward=exact", "env.args.reward: must be one of arithmetic, math_verify, got 'exact'"),
        ("tool_format=hermes", "env.args.tool_format: is set by env.tool_format, not env.args"),
    ],
)
def test_config_checks_the_tool_and_sandbox_arguments_by_name(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*FITS, f"env.args.{override}"])
    assert message in str(err.value)


def test_sandbox_arguments_reach_its_limits():
    args = {"cpu_s": 2, "wall_s": 5.0, "memory_mb": 256, "max_processes": 2, "max_file_mb": 8}
    cfg = load_config(None, [*FITS, *(f"env.args.{k}={v}" for k, v in args.items())])
    limits = PythonTool(**cfg.env.args).limits
    assert {k: getattr(limits, k) for k in args} == args
    # Two processes: the code and one child; a second child at the same time is refused.
    code = """
import subprocess
first = subprocess.Popen(["sleep", "3"])
try:
    subprocess.Popen(["sleep", "3"])
    print("two children")
except OSError as err:
    print("one child;", type(err).__name__)
first.kill()
"""
    step = PythonTool(**cfg.env.args, system_prompt=False).step(_call(code))
    assert step.messages == [{"role": "tool", "content": "one child; BlockingIOError"}]


def test_demo_conversations_call_the_tool_in_the_share_asked():
    records = tool_use_records(400, seed=1, tool_frac=0.3)
    with_tool = [r for r in records if len(r["messages"]) == 4]
    assert 0.2 < len(with_tool) / len(records) < 0.4
    for r in with_tool:
        user, call, result, answer = r["messages"]
        (parsed,) = parse_tool_calls(call["content"], "hermes").calls
        assert parsed.arguments["code"] == f"print({user['content']})"
        assert result == {"role": "tool", "content": answer["content"]}
        assert str(eval(user["content"])) == answer["content"]
    assert tool_use_records(5, seed=1, tool_frac=0.3) == records[:5]
