"""The ``openenv`` environment: OpenEnv environments (written with openenv-core's own base
classes) run under ``env_agent``, in process and served by OpenEnv's own HTTP/websocket server
(``create_app`` under uvicorn on 127.0.0.1) through OpenEnv's own client.

The rollouts on the real tiny model (HFServer) check what training needs: the mask-1 tokens are
exactly the engine's, the observations are mask-0 tokens, the reward and done are the
environment's, a failing step fails its sample and is counted. The mapping details (action
fields, MCP tool calls, errors) run on a scripted engine so each test controls the turn's text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv", reason='OpenEnv environments need openenv-core: pip install "agentloop-tools[openenv]"')

from fastmcp import FastMCP  # noqa: E402 - openenv-core depends on fastmcp
from openenv.core.env_server.http_server import create_app  # noqa: E402
from openenv.core.env_server.interfaces import Environment as OpenEnvBase  # noqa: E402
from openenv.core.env_server.mcp_environment import MCPEnvironment  # noqa: E402
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402
from pydantic import Field  # noqa: E402

from agentloop_core.environment import EnvironmentError, get_environment_class  # noqa: E402
from agentloop_core.imports import import_object  # noqa: E402
from agentloop_core.runtime import AgentLoopManager  # noqa: E402
from agentloop_core.testing import ScriptedServer, load_tiny_tokenizer  # noqa: E402
from agentloop_tools.env_agent import EnvAgentLoop  # noqa: E402
from agentloop_tools.openenv_adapter import OpenEnvEnvironment, text_action_field  # noqa: E402

PROMPT = [{"role": "system", "content": "You guess numbers."}, {"role": "user", "content": "(unused)"}]
SEEN: list[str] = []


class GuessAction(Action):
    guess: str = Field(description="The model's guess, as text.")


class GuessObservation(Observation):
    prompt: str = Field(default="", description="What the model reads next.")


class GuessEnv(OpenEnvBase[GuessAction, GuessObservation, State]):
    """Wants ``target`` (the number 7) within ``max_tries``; each wrong try pays ``effort`` (so a random
    model's reward is known), the right one 1.0. ``fail_on``: the step that raises."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, max_tries: int = 3, effort: float = 0.25, fail_on: int | None = None, target: str = "7") -> None:
        super().__init__()
        self.max_tries, self.effort, self.fail_on, self.target = max_tries, effort, fail_on, target
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt="Guess my number (1-9).", metadata={"episode_id": episode_id, "seed": seed})

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        SEEN.append(action.guess)
        if self.fail_on == self._state.step_count:
            raise RuntimeError("the guessing board fell over")
        self._state.step_count += 1
        right = action.guess.strip() == self.target
        done = right or self._state.step_count >= self.max_tries
        return GuessObservation(prompt="Correct!" if right else "Wrong, try again.", done=done,
                                reward=1.0 if right else self.effort, metadata={"tries": self._state.step_count})

    @property
    def state(self) -> State:
        return self._state


class NoteAction(Action):
    title: str = ""
    body: str = ""


class NoteEnv(OpenEnvBase):
    """Two text fields, declared only by step's annotation: the mapping is ambiguous."""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        return GuessObservation(prompt="Write a note.")

    def step(self, action: NoteAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        return GuessObservation(prompt=f"{action.title}|{action.body}", done=True, reward=float(len(action.body)))

    @property
    def state(self) -> State:
        return State()


class AdderMCPEnv(MCPEnvironment):
    """An MCP environment: an ``add`` tool; resets to an empty observation."""

    def __init__(self) -> None:
        mcp = FastMCP("adder")

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two numbers."""
            return a + b

        super().__init__(mcp)
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        return Observation()

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=True, reward=1.0)

    @property
    def state(self) -> State:
        return self._state


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


@pytest.fixture(autouse=True)
def _clear():
    SEEN.clear()


def scripted(tokenizer, turns: list[str]) -> ScriptedServer:
    def reply(request_id: str, prompt_ids: list[int], index: int) -> list[int]:
        return tokenizer.encode(turns[min(index, len(turns) - 1)], add_special_tokens=False)

    return ScriptedServer(reply, eos_token_id=tokenizer.eos_token_id, append_eos=True)


def row(request_id: str = "ep-1", **env: Any) -> dict[str, Any]:
    return {"raw_prompt": PROMPT, "request_id": request_id,
            "extra_info": {"environment": "openenv", "environment_kwargs": env}}


def guess(**env_kwargs: Any) -> dict[str, Any]:
    return {"env": f"{__name__}:GuessEnv", "env_kwargs": env_kwargs}


def test_registered_by_name_and_declared_as_an_entry_point():
    assert get_environment_class("openenv") is OpenEnvEnvironment
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    entry = pyproject["project"]["entry-points"]["agentloop.environments"]["openenv"]
    assert import_object(entry.replace(":", "."), where="entry point") is OpenEnvEnvironment


async def test_in_process_text_action_reward_done_and_metadata(tokenizer):
    server = scripted(tokenizer, ["3", "7"])
    out = await EnvAgentLoop(server, tokenizer, {"response_length": 512}).run({"temperature": 0.0}, **row(**guess()))
    assert SEEN == ["3", "7"]
    assert out.extra_fields["step_rewards"] == [0.25, 1.0]
    assert out.reward_score == pytest.approx(1.25)
    assert out.extra_fields["termination_reason"] == "env_done"
    infos = out.extra_fields["step_infos"]
    assert infos[0]["info"]["reset_metadata"] == {"episode_id": "ep-1", "seed": None}
    assert [i["info"]["metadata"] for i in infos] == [{"tries": 1}, {"tries": 2}]
    messages = out.extra_fields["messages"]
    assert messages[0] == PROMPT[0]  # the row's system message stays; the observation is the user turn
    assert messages[1] == {"role": "user", "content": "Guess my number (1-9)."}
    assert messages[3] == {"role": "user", "content": "Wrong, try again."}


async def test_config_selects_openenv_and_reset_kwargs_reach_the_env(tokenizer):
    config = {"response_length": 512, "environment": "openenv",
              "environment_kwargs": {**guess(max_tries=1), "reset_kwargs": {"seed": 5}}}
    out = await EnvAgentLoop(scripted(tokenizer, ["2"]), tokenizer, config).run({}, raw_prompt=PROMPT)
    assert out.extra_fields["step_infos"][0]["info"]["reset_metadata"]["seed"] == 5
    assert out.reward_score == pytest.approx(0.25)


async def test_ambiguous_action_names_its_fields_and_the_hooks_fix_it(tokenizer):
    env = {"env": f"{__name__}:NoteEnv"}
    with pytest.raises(EnvironmentError, match=r"which field of NoteAction.*title: string, body: string.*action_field"):
        await EnvAgentLoop(scripted(tokenizer, ["hi"]), tokenizer).run({}, **row(**env))
    out = await EnvAgentLoop(scripted(tokenizer, ["hello"]), tokenizer).run({}, **row(**env, action_field="body"))
    assert out.reward_score == 5.0
    hook = f"{__name__}:note_from_turn"
    out = await EnvAgentLoop(scripted(tokenizer, ["abc"]), tokenizer).run({}, **row(**env, action=hook))
    assert out.reward_score == 6.0  # the hook's body: "abcabc"


def note_from_turn(turn, action_class):
    assert action_class is NoteAction
    return NoteAction(title="t", body=turn.content * 2)


def test_text_action_field_rules():
    schema = GuessAction.model_json_schema()
    assert text_action_field(schema) == "guess"
    with pytest.raises(EnvironmentError, match=r"action_field='nope' is not a field of GuessAction; its fields: guess"):
        text_action_field(schema, "nope")
    optional = {"title": "A", "properties": {"a": {"type": "string"}, "b": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
                "required": ["a"]}
    assert text_action_field(optional) == "a"


def test_bad_configs_name_the_fix():
    with pytest.raises(ValueError, match=r"exactly one of environment_kwargs.env .* environment_kwargs.base_url"):
        OpenEnvEnvironment()
    with pytest.raises(ValueError, match=r"pass its class"):
        OpenEnvEnvironment(env=GuessEnv())


# openenv-core 0.3.0's MCPEnvironment list_tools reads the FastMCP field its newer versions renamed.
@pytest.mark.filterwarnings("ignore:Accessing `Tool.inputSchema` is deprecated")
async def test_mcp_environment_tool_calls_become_call_tool_actions(tokenizer):
    call = "<tool_call>\n" + json.dumps({"name": "add", "arguments": {"a": 3, "b": 4}}) + "\n</tool_call>"
    server = scripted(tokenizer, [call, "The sum is 7."])
    prompt = [{"role": "user", "content": "Add 3 and 4 with the tool."}]
    out = await EnvAgentLoop(server, tokenizer).run({}, **{**row(env=f"{__name__}:AdderMCPEnv"), "raw_prompt": prompt})
    assert "add" in tokenizer.decode(server.calls[0].prompt_ids)  # the MCP tool is in the prompt
    assert out.extra_fields["messages"][0] == prompt[0]  # an empty reset observation keeps the row's prompt
    tools = [m for m in out.extra_fields["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tools] == ["7"]
    assert out.extra_fields["step_infos"][-1]["info"] == {"ended": "no_tool_call"}
    assert out.extra_fields["termination_reason"] == "env_done"
    assert out.metrics["tool_calls"] == 1


@pytest.mark.filterwarnings("ignore:Accessing `Tool.inputSchema` is deprecated")
async def test_served_mcp_environment_lists_and_calls_tools_over_the_wire(tokenizer):
    call = "<tool_call>\n" + json.dumps({"name": "add", "arguments": {"a": 2, "b": 5}}) + "\n</tool_call>"
    server = scripted(tokenizer, [call, "Seven."])
    with serve(create_app(AdderMCPEnv, CallToolAction, CallToolObservation)) as served:
        out = await EnvAgentLoop(server, tokenizer).run({}, **row(base_url=served.url))
    assert "add" in tokenizer.decode(server.calls[0].prompt_ids)
    assert [m["content"] for m in out.extra_fields["messages"] if m["role"] == "tool"] == ["7"]
    assert out.extra_fields["termination_reason"] == "env_done"


class OfflineMCPEnv(AdderMCPEnv):
    async def _async_list_tools(self) -> list:
        raise RuntimeError("tool registry offline")


async def test_an_mcp_tool_listing_that_fails_fails_the_sample(tokenizer):
    # openenv's list_tools catches the error and reports it only in the observation's metadata:
    # the adapter must not run on with no tools.
    with pytest.raises(EnvironmentError, match=r"OfflineMCPEnv: list_tools failed: tool registry offline"):
        await EnvAgentLoop(scripted(tokenizer, ["x"]), tokenizer).run({}, **row(env=f"{__name__}:OfflineMCPEnv"))


# --- the real tiny model, in process and served ---------------------------------------------------

class Recording:
    """Delegates to the real engine and keeps each output (no behaviour of its own)."""

    def __init__(self, server) -> None:
        self.server, self.capabilities, self.outputs = server, server.capabilities, []

    async def generate(self, request_id, prompt_ids, sampling_params):
        out = await self.server.generate(request_id, prompt_ids, sampling_params)
        self.outputs.append(out)
        return out


@pytest.fixture(scope="module")
def engine():
    hf = pytest.importorskip("agentloop_engines.adapters.hf", reason='the tiny model needs "agentloop-engines[hf]"')
    tiny_model = pytest.importorskip("agentloop_engines.testing.tiny_model", reason="agentloop-engines is not installed")
    return hf.HFServer(tiny_model.build_tiny_model(), seed=0)


def serve(app):
    http_common = pytest.importorskip("agentloop_engines.serving.common", reason="agentloop-engines is not installed")
    return http_common.UvicornThread(app)


# A guess the random model cannot make (its turns are one or two tokens): every rollout takes all
# three tries, whatever the sampling order of the tests.
UNREACHABLE = "a number the model cannot guess"
# A random model rarely samples EOS; stopping on every other id makes one- or two-token turns
# that end cleanly (a turn cut by length is not stepped), so all three tries are taken.
SAMPLING = {"temperature": 1.0, "top_k": 0, "logprobs": True, "max_tokens": 32}


def sampling(tokenizer) -> dict[str, Any]:
    return {**SAMPLING, "stop_token_ids": list(range(0, len(tokenizer), 2))}


def check_exact_tokens(out, recording, tokenizer) -> None:
    generated = [t for o in recording.outputs for t in o.token_ids]
    assert [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m] == generated
    logprobs = [lp for o in recording.outputs for lp in o.log_probs]
    assert [lp for lp, m in zip(out.response_logprobs, out.response_mask, strict=True) if m] == logprobs
    feedback = tokenizer.decode([t for t, m in zip(out.response_ids, out.response_mask, strict=True) if not m])
    assert feedback.count("Wrong, try again.") + feedback.count("Correct!") == len(recording.outputs) - 1


async def test_in_process_rollout_on_the_tiny_model_keeps_the_engine_tokens(engine, tokenizer):
    recording = Recording(engine)
    out = await EnvAgentLoop(recording, tokenizer, {"response_length": 512}).run(
        sampling(tokenizer), **row(**guess(target=UNREACHABLE)))
    assert len(recording.outputs) == len(SEEN) == 3  # three tries, then done
    check_exact_tokens(out, recording, tokenizer)
    assert out.extra_fields["termination_reason"] == "env_done"
    assert out.reward_score == pytest.approx(0.75)
    assert [i["info"]["metadata"]["tries"] for i in out.extra_fields["step_infos"]] == [1, 2, 3]


async def test_served_rollout_through_openenvs_client_keeps_the_engine_tokens(engine, tokenizer):
    app = create_app(lambda: GuessEnv(target=UNREACHABLE), GuessAction, GuessObservation, max_concurrent_envs=4)
    with serve(app) as served:
        recording = Recording(engine)
        env = {"base_url": served.url, "reset_kwargs": {"seed": 3}}
        out = await EnvAgentLoop(recording, tokenizer, {"response_length": 512}).run(sampling(tokenizer), **row(**env))
    check_exact_tokens(out, recording, tokenizer)
    assert len(SEEN) == 3
    assert out.extra_fields["termination_reason"] == "env_done"
    assert out.reward_score == pytest.approx(0.75)
    assert out.extra_fields["step_rewards"] == [0.25, 0.25, 0.25]


async def test_a_failing_served_step_fails_the_sample_with_the_servers_error(engine, tokenizer):
    failing = create_app(lambda: GuessEnv(fail_on=0), GuessAction, GuessObservation)
    with serve(failing) as served, pytest.raises(
            EnvironmentError, match=r"environment 'openenv' step failed: RuntimeError: Server error: .*fell over"):
        await EnvAgentLoop(engine, tokenizer).run(sampling(tokenizer), **row(base_url=served.url))


def test_a_failing_step_fails_its_sample_and_is_counted(engine, tokenizer):
    rows = [{**row("ok", **guess(target=UNREACHABLE)), "agent_name": "env_agent"},
            {**row("bad", **guess(target=UNREACHABLE, fail_on=1)), "agent_name": "env_agent"}]
    manager = AgentLoopManager(engine, tokenizer, {"default_agent_loop": "env_agent", "response_length": 512,
                                                   "sampling_params": sampling(tokenizer)})
    try:
        batch = manager.generate_sequences(rows)
    finally:
        manager.shutdown()
    assert batch.failed.tolist() == [False, True]
    assert batch.metrics["rollout/num_failed"] == 1
    assert batch.rewards[0] == pytest.approx(0.75)
