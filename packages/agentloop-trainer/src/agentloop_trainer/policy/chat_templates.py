"""``model.custom_chat_template``: the chat template a run's tokenizers get, and the start-up
check that the template shows the model the run's tools.

The template is set once on each tokenizer where it is loaded (:func:`apply_custom_chat_template`
from :func:`~agentloop_trainer.policy.tokenizer.load_tokenizer`), so everything rendering from that
tokenizer (the loops, the prompt-length filter, SFT, ``save_pretrained`` of checkpoints and
exported folders) uses it. What loads a tokenizer by path elsewhere gets the text with it: Ray
rollout workers (the worker key ``custom_chat_template``), engines built from an
:class:`~agentloop_core.engine_registry.EngineConfig` (its ``chat_template``).
"""

from __future__ import annotations

from typing import Any

from agentloop_trainer.config_base import ConfigError
from agentloop_trainer.policy.settings import ModelSection

__all__ = ["TemplateIgnoresToolsError", "apply_custom_chat_template", "check_template_renders_tools",
           "custom_chat_template"]

FIX = "model.custom_chat_template=chatml-hermes"
"""The override that fixes a ChatML model whose template ignores tools (named in errors)."""


class TemplateIgnoresToolsError(ConfigError):
    """The run has tools and its chat template does not show them to the model (the CLI exits
    with code 2)."""


def custom_chat_template(model: ModelSection) -> str | None:
    """The Jinja text ``model.custom_chat_template`` names, or None when it is unset.

    Raises:
        ConfigError: an unknown name or a missing file, listing the built-in names.
    """
    from agentloop_core.tokenization import resolve_chat_template

    value = model.custom_chat_template
    if value is None or value == "":
        return None
    try:
        return resolve_chat_template(str(value))
    except ValueError as exc:
        raise ConfigError(f"config model.custom_chat_template: {exc}") from exc


def apply_custom_chat_template(model: ModelSection, tokenizer: Any) -> Any:
    """``tokenizer`` with ``model.custom_chat_template`` as its chat template (unchanged when
    the key is unset); returns it."""
    from agentloop_core.tokenization import set_chat_template

    return set_chat_template(tokenizer, custom_chat_template(model))


def check_template_renders_tools(model: ModelSection, tokenizer: Any, source: str,
                                 schemas: list[dict[str, Any]] | None, *, default_agent_loop: str) -> None:
    """Fail at start-up, before any rollout, when the run has tools and its chat template ignores
    ``tools=``: every trajectory would be wasted (the model never sees the schemas), and the
    per-sample check in the tool loop would only fail each sample of the first rollout.

    Asked once per tokenizer and template (core's
    :func:`~agentloop_core.tokenization.renders_tools`). A run whose default loop is
    ``single_turn_agent`` renders no tools and is not checked.

    Args:
        model: The ``model`` section (its ``custom_chat_template``, named by the error).
        tokenizer: The run's tokenizer, with ``model.custom_chat_template`` applied.
        source: Where the tokenizer came from (a folder), for the message.
        schemas: The run's tool schemas (``agentloop_trainer.rollout.run_config.tool_schemas``);
            None or empty: the run has no tools (nothing to check).
        default_agent_loop: ``actor_rollout_ref.rollout.agent.default_agent_loop``.

    Raises:
        ConfigError: naming the tools and the fix (``model.custom_chat_template``).
    """
    from agentloop_core.tokenization import chat_template_names, renders_tools

    if default_agent_loop == "single_turn_agent":
        return
    if not schemas:
        return
    names = sorted(s["function"]["name"] for s in schemas)
    set_key = model.custom_chat_template
    where = f"model.custom_chat_template={set_key}" if set_key else f"the chat template of {source}"
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateIgnoresToolsError(
            f"{source} has no chat template, so the run's tools {names} cannot be shown to the model; set "
            f"{FIX} (built-ins: {', '.join(chat_template_names())}) or model.custom_chat_template=/path/to/"
            "template.jinja")
    if renders_tools(tokenizer):
        return
    raise TemplateIgnoresToolsError(
        f"{where} ignores tools= (a prompt renders the same with and without tool schemas), so the model would "
        f"never see the run's tools {names} and every trajectory would be wasted. Set {FIX} (a built-in "
        f"tool-aware ChatML template with hermes tool calls; built-ins: {', '.join(chat_template_names())}), or "
        "model.custom_chat_template=/path/to/template.jinja for a template of your own, and "
        "actor_rollout_ref.rollout.multi_turn.tool_parser to the tool parser that reads its calls")
