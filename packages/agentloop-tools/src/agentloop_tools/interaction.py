"""Interactions: a simulated user that answers the model between its turns.

When the model ends a turn without calling a tool, the tool agent loop asks the interaction
for the user's reply. The reply is appended as a ``user`` message (response mask 0) and the
model generates again, until the interaction says the conversation is over or the loop's
``max_user_turns`` is reached. Each reply carries a score, kept per turn in
``extra_fields["turn_scores"]``.

Several interactions can be configured at once, verl-style, in a YAML file::

    interaction:
      - name: gsm8k
        class_name: agentloop_tools.interaction.Gsm8kInteraction
        config: {retry_message: "Try again."}

and each row picks one with ``interaction_kwargs["name"]`` (when only one is configured, it
serves every row). The whole ``interaction_kwargs``, ``name`` included as in verl, goes to
``start``.
"""

from __future__ import annotations

import abc
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentloop_tools.load_tools import import_object, read_yaml_list


class BaseInteraction(abc.ABC):
    """A user simulator. One object serves every trajectory at once; per-trajectory state
    lives under the ``instance_id`` that :meth:`start` returns.

    Args:
        config: Interaction options (from the loop config's ``interaction.config``).
    """

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config: dict[str, Any] = dict(config or {})
        self.name: str = str(self.config.get("name", type(self).__name__))
        self._instances: dict[str, dict[str, Any]] = {}

    async def start(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Begin one conversation.

        Args:
            instance_id: Id to use; None makes a fresh unique one.
            **kwargs: The row's ``interaction_kwargs`` (e.g. ``ground_truth``).

        Returns:
            The instance id to pass to the other methods.

        Raises:
            ValueError: The id is already live.
        """
        iid = instance_id if instance_id is not None else f"{self.name}-{uuid.uuid4().hex}"
        if iid in self._instances:
            raise ValueError(f"interaction {self.name!r}: instance {iid!r} already started; finalize it first")
        self._instances[iid] = dict(kwargs)
        return iid

    def state(self, instance_id: str) -> dict[str, Any]:
        """The mutable state of one live conversation.

        Raises:
            KeyError: ``start`` was not called for this id, or it was finalized.
        """
        try:
            return self._instances[instance_id]
        except KeyError:
            raise KeyError(f"interaction {self.name!r} has no live instance {instance_id!r}; call start() first") from None

    @abc.abstractmethod
    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """Reply to the model's last turn.

        Args:
            instance_id: From :meth:`start`.
            messages: The conversation so far, the model's last message included.

        Returns:
            ``(should_terminate, response_text, score, metrics)``. When ``should_terminate`` is
            true the loop ends the trajectory and does not append ``response_text``.
        """

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """The interaction's score for the whole conversation (default: the last turn score)."""
        scores = self.state(instance_id).get("turn_scores", [])
        return float(scores[-1]) if scores else 0.0

    async def finalize(self, instance_id: str, **kwargs: Any) -> None:
        """Drop the conversation's state; finalizing an unknown id is a no-op."""
        self._instances.pop(instance_id, None)

    @property
    def live_instances(self) -> int:
        """How many conversations are started and not yet finalized."""
        return len(self._instances)


def load_interaction(spec: BaseInteraction | Mapping[str, Any] | None) -> BaseInteraction | None:
    """Resolve the loop config's ``interaction`` entry.

    Args:
        spec: An interaction object, a mapping ``{"class_name": "pkg.module:Class",
            "config": {...}}``, or None.

    Returns:
        The interaction, or None when ``spec`` is None.

    Raises:
        ValueError: The mapping lacks ``class_name``, the class cannot be imported, or it is
            not a :class:`BaseInteraction` subclass.
    """
    if spec is None or isinstance(spec, BaseInteraction):
        return spec
    if not isinstance(spec, Mapping):
        raise ValueError(f"interaction must be a BaseInteraction or a mapping with 'class_name', got {type(spec).__name__}")
    unknown = set(spec) - {"class_name", "config", "name"}
    if unknown:
        raise ValueError(f"interaction config has unknown keys {sorted(unknown)}; accepted: class_name, config, name")
    class_name = spec.get("class_name")
    if not isinstance(class_name, str):
        raise ValueError("interaction config needs 'class_name': 'package.module:ClassName'")
    cls = import_object(class_name, where="interaction class_name")
    if not (isinstance(cls, type) and issubclass(cls, BaseInteraction)):
        raise ValueError(f"{class_name!r} is not a subclass of agentloop_tools.interaction.BaseInteraction")
    config = dict(spec.get("config") or {})
    if "name" in spec:
        config.setdefault("name", spec["name"])
    return cls(config)


def load_interactions(spec: Any) -> dict[str, BaseInteraction]:
    """Resolve one interaction or a list of them (verl's ``interaction:`` list), by name.

    Args:
        spec: None, anything :func:`load_interaction` takes, a list of those, or a mapping
            ``{"interaction": [...]}`` (the content of an interaction YAML file).

    Returns:
        The interactions by their ``name`` (empty for None).

    Raises:
        ValueError: A bad entry (see :func:`load_interaction`) or two interactions with one name.
    """
    if spec is None:
        return {}
    if isinstance(spec, Mapping) and set(spec) == {"interaction"}:
        spec = spec["interaction"]
    entries = spec if isinstance(spec, (list, tuple)) else [spec]
    interactions: dict[str, BaseInteraction] = {}
    for i, entry in enumerate(entries):
        try:
            interaction = load_interaction(entry)
        except ValueError as exc:
            raise ValueError(f"interaction[{i}]: {exc}") from exc
        if interaction is None:
            raise ValueError(f"interaction[{i}] is empty; give class_name and config")
        if interaction.name in interactions:
            raise ValueError(f"interaction[{i}]: two interactions are named {interaction.name!r}; give each a "
                             "distinct 'name'")
        interactions[interaction.name] = interaction
    return interactions


def load_interaction_config(path: str | Path) -> dict[str, BaseInteraction]:
    """Build the interactions of a verl-style YAML file (see the module docstring).

    Raises:
        FileNotFoundError: No such file.
        ValueError: Bad YAML or a bad entry; the message names the file.
    """
    file, entries = read_yaml_list(path, "interaction", what="interaction config",
                                   entries="{name, class_name, config} entries")
    try:
        return load_interactions(entries)
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from exc


def select_interaction(interactions: Mapping[str, BaseInteraction],
                       interaction_kwargs: Mapping[str, Any] | None) -> BaseInteraction | None:
    """The interaction a row asks for with ``interaction_kwargs["name"]`` when several are
    configured; the only one when one is (whatever name the row gives, so rows written for
    another name keep working); None when none is.

    Raises:
        ValueError: Several are configured and the row names none, or one that is not configured.
    """
    if not interactions:
        return None
    if len(interactions) == 1:
        return next(iter(interactions.values()))
    name = (interaction_kwargs or {}).get("name")
    if name is None:
        raise ValueError(f"several interactions are configured ({sorted(interactions)}); the row must pick one "
                         "with interaction_kwargs={'name': ...}")
    if name not in interactions:
        raise ValueError(f"row interaction_kwargs names interaction {name!r}, which is not configured; "
                         f"configured: {sorted(interactions)}")
    return interactions[name]


_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def extract_final_answer(text: str) -> str | None:
    """The number after the last ``#### `` marker (GSM8K's answer format), commas removed."""
    found = _ANSWER.findall(text or "")
    return found[-1].replace(",", "") if found else None


class Gsm8kInteraction(BaseInteraction):
    """Checks the model's ``#### <answer>`` against ``ground_truth``; ends the conversation on a
    correct answer, or when its answers are used up; otherwise asks it to try again.

    ``start(instance_id, ground_truth="42")`` takes the row's ``interaction_kwargs``. Config:
    ``retry_message`` (text sent after a wrong answer), ``correct_score``/``wrong_score``,
    ``max_attempts`` (answers checked per conversation, default 1: a "wrong, try again" to
    every guess, with the last answer's score as the reward, lets a policy search for the
    answer; set it to N, or null for as many as ``max_user_turns`` allows, for a
    self-correction curriculum). A turn with no ``####`` answer does not use an attempt.

    Raises:
        ValueError: ``max_attempts`` is not a positive integer or null.
    """

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        limit = self.config.get("max_attempts", 1)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"interaction {self.name!r}: config max_attempts must be a positive integer or null "
                             f"(as many as max_user_turns allows), got {limit!r}")
        self.max_attempts: int | None = limit

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = self.state(instance_id)
        if "ground_truth" not in state:
            raise ValueError("Gsm8kInteraction needs interaction_kwargs={'ground_truth': ...} in the row")
        last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
        answer = extract_final_answer(str((last or {}).get("content") or ""))
        correct = answer is not None and _same_number(answer, str(state["ground_truth"]))
        score = float(self.config.get("correct_score", 1.0) if correct else self.config.get("wrong_score", 0.0))
        state.setdefault("turn_scores", []).append(score)
        state["attempts"] = state.get("attempts", 0) + int(answer is not None)
        if correct:
            return True, "Correct.", score, {"answered": 1}
        if self.max_attempts is not None and state["attempts"] >= self.max_attempts:
            return True, "That is not right, and no attempts are left.", score, {"answered": 1}
        reply = self.config.get(
            "retry_message",
            "That is not right. Check your work and give the final answer after '#### '.",
        )
        return False, str(reply), score, {"answered": int(answer is not None)}


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b.replace(",", "").strip())
    except ValueError:
        return a.strip() == b.strip()


__all__ = [
    "BaseInteraction",
    "Gsm8kInteraction",
    "extract_final_answer",
    "load_interaction",
    "load_interaction_config",
    "load_interactions",
    "select_interaction",
]
