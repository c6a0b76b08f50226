"""A model-judged reward's settings, prompt template and score parser (``reward.judge``).

The judge reads one finished trajectory at a time: the row's prompt, the text the policy
generated and the ground truth go into the prompt template, the judge model replies, and the
parser takes the score out of the reply. The calls themselves (an OpenAI-compatible server or
the policy's own engine, with retries and a concurrency limit) are
:mod:`agentloop_trainer.reward.judge_client`; how the score joins the rule reward is
:class:`agentloop_trainer.reward.scoring.RewardScorer`.
"""

from __future__ import annotations

import json
import math
import os
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from agentloop_trainer.reward.rubric import Criterion, check_rubric, criteria_text, map_score, rubric_score
from agentloop_trainer.reward.settings import JudgeSection

POLICY = "policy"
"""``reward.judge.url`` value that makes the policy's own rollout engine the judge."""
PARSERS = ("regex", "json")
"""Values of ``reward.judge.parser``."""
COMBINE = ("replace", "add")
"""Values of ``reward.judge.combine``."""
SINGLE, GROUP = "single", "group"
MODES = (SINGLE, GROUP)
"""Values of ``reward.judge.mode``: each trajectory judged on its own, or a GRPO group's
trajectories judged together in one request (relative scoring, as ART's RULER;
:mod:`agentloop_trainer.reward.group_judge`)."""
PLACEHOLDERS = ("question", "prompt", "response", "ground_truth", "data_source")
"""What a prompt template may name: the row's last user message, its whole prompt (one
``role: text`` line per message), the policy's generated text, the row's ground truth and its
data_source. With a rubric, also ``criteria``; in group mode ``responses`` and ``n`` stand
for ``response`` (:data:`GROUP_PLACEHOLDERS`)."""
GROUP_PLACEHOLDERS = ("question", "prompt", "responses", "n", "ground_truth", "data_source")
"""What a group-mode template may name: ``responses`` is the group's answers, numbered from 1,
each in ``<answer id="i">...</answer>``; ``n`` is how many there are."""

DEFAULT_PROMPT = """You are grading an answer to a question.

Question:
{question}

Reference answer:
{ground_truth}

Answer to grade:
{response}

How correct is the answer, from 0 (wrong) to 10 (fully correct)? End your reply with the line \
"Score: N"."""
"""The prompt ``reward.judge.prompt=null`` uses (pairs with the default pattern and 0-10 range)."""

DEFAULT_RUBRIC_PROMPT = """You are grading an answer to a question on several criteria.

Question:
{question}

Reference answer:
{ground_truth}

Answer to grade:
{response}

Criteria:
{criteria}

Score the answer on each criterion from 0 (worst) to 10 (best). End your reply with one JSON \
object mapping each criterion's name to its score, e.g. {{"scores": {{"name": 7}}}}."""
"""The prompt of a single-mode rubric judge with ``reward.judge.prompt=null``."""

DEFAULT_GROUP_PROMPT = """You are comparing {n} answers to the same question.

Question:
{question}

Reference answer:
{ground_truth}

The answers:
{responses}

Score every answer from 0 (wrong) to 10 (fully correct), relative to the others: a better \
answer gets a higher score. Reply with one JSON object holding one score per answer, in \
order: {{"scores": [s1, s2, ...]}}."""
"""The prompt of a group judge with ``reward.judge.prompt=null``."""

DEFAULT_GROUP_RUBRIC_PROMPT = """You are comparing {n} answers to the same question on several criteria.

Question:
{question}

Reference answer:
{ground_truth}

The answers:
{responses}

Criteria:
{criteria}

Score every answer on each criterion from 0 (worst) to 10 (best), relative to the others. \
Reply with one JSON object holding, per answer in order, an object mapping each criterion's \
name to its score: {{"scores": [{{"name": 7}}, ...]}}."""
"""The prompt of a group judge with a rubric and ``reward.judge.prompt=null``."""


class JudgeError(RuntimeError):
    """A judgement that failed after its retries; the message says why (the last attempt's
    error, and what the judge replied when it replied)."""


def _key(name: str) -> str:
    return f"reward.judge.{name}"


def check_template(template: str, where: str = "reward.judge.prompt",
                   allowed: Sequence[str] = PLACEHOLDERS) -> None:
    """Raises ValueError naming ``where`` when ``template`` names a field other than ``allowed``
    (:data:`PLACEHOLDERS` unless given), has an attribute or index in one, or has unbalanced braces."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ValueError(f"{where}: {exc} (write a literal brace as {{{{ or }}}})") from None
    bad = sorted({f for f in fields if f not in allowed})
    if bad:
        raise ValueError(f"{where} names {bad}; a template may use {{{'}, {'.join(allowed)}}} "
                         "(write a literal brace as {{ or }})")


def render_prompt(template: str, values: Mapping[str, str]) -> str:
    """``template`` with its placeholders filled from ``values`` (every name it uses must be
    there; extra names are ignored)."""
    return template.format_map(dict(values))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def prompt_values(messages: Sequence[Mapping[str, Any]] | None, response: str, ground_truth: Any,
                  data_source: str | None) -> dict[str, str]:
    """The template's values for one trajectory: ``messages`` is the row's prompt (raw chat)."""
    messages = list(messages or [])
    users = [m for m in messages if m.get("role") == "user"]
    return {
        "question": _content_text(users[-1].get("content")) if users else "",
        "prompt": "\n".join(f"{m.get('role')}: {_content_text(m.get('content'))}" for m in messages),
        "response": response,
        "ground_truth": "" if ground_truth is None else str(ground_truth),
        "data_source": "" if data_source is None else str(data_source),
    }


def last_json_object(text: str) -> Any:
    """The last top-level JSON object in ``text`` (objects nested in it are part of it), or None."""
    decoder = json.JSONDecoder()
    found, at = None, text.find("{")
    while at != -1:
        try:
            found, end = decoder.raw_decode(text, at)
        except ValueError:
            end = at + 1
        at = text.find("{", end)
    return found


@dataclass
class JudgeSettings(JudgeSection):
    """The ``reward.judge`` section, checked and resolved by :meth:`from_section`: its keys are
    :class:`~agentloop_trainer.reward.settings.JudgeSection`'s (declared once there), with
    ``prompt`` the template text (a file's contents read; None: the built-in prompt of the mode),
    ``url`` set and ``score_range`` a checked ``[low, high]``, plus the rubric's criteria checked
    (:attr:`criteria`); what the rollout workers get, so it pickles."""

    criteria: tuple[Criterion, ...] = ()
    """``rubric``'s criteria, checked (:func:`~agentloop_trainer.reward.rubric.check_rubric`);
    empty: one score."""

    @classmethod
    def from_section(cls, section: Any) -> JudgeSettings | None:
        """The settings of a ``reward.judge`` section (None when it is not enabled).

        Raises:
            ValueError: naming the ``reward.judge`` key that is wrong and what it must be.
        """
        if not section.enable:
            return None
        if not section.url:
            raise ValueError(f"{_key('url')} must be set with {_key('enable')}=true: an OpenAI-compatible base "
                             "URL such as http://127.0.0.1:8001/v1 (e.g. `agentloop serve CHECKPOINT --port 8001`), "
                             f"or {POLICY} to judge with the policy's own engine")
        url = str(section.url)
        if url != POLICY and not re.match(r"https?://", url):
            raise ValueError(f"{_key('url')} must be an http(s) URL or {POLICY!r}, got {url!r}")
        if section.api_key_env and not os.environ.get(str(section.api_key_env)):
            raise ValueError(f"{_key('api_key_env')} names {section.api_key_env!r}, which is not set in the "
                             "environment; export it with the judge's API key (the key never goes in the config)")
        mode = str(getattr(section, "mode", SINGLE))
        if mode not in MODES:
            raise ValueError(f"{_key('mode')} must be one of {MODES} (single: each trajectory on its own; group: "
                             f"a GRPO group's trajectories in one request, scored relative to each other), got {mode!r}")
        rubric = check_rubric(getattr(section, "rubric", None), _key("rubric"))
        prompt = _default_prompt(mode, rubric) if section.prompt is None else str(section.prompt)
        if section.prompt is not None and "{" not in prompt and "\n" not in prompt:
            path = Path(prompt).expanduser()
            if not path.is_file():
                raise ValueError(f"{_key('prompt')} {prompt!r} is neither a template (it has no {{response}} or "
                                 "other placeholder) nor an existing file")
            prompt = path.read_text(encoding="utf-8")
        _check_prompt(prompt, mode, rubric)
        if section.parser not in PARSERS:
            raise ValueError(f"{_key('parser')} must be one of {PARSERS}, got {section.parser!r}")
        if section.parser == "regex":
            try:
                groups = re.compile(str(section.pattern)).groups
            except re.error as exc:
                raise ValueError(f"{_key('pattern')} {section.pattern!r} is not a regex: {exc}") from None
            if groups != 1:
                raise ValueError(f"{_key('pattern')} must have exactly one capturing group (the score), "
                                 f"{section.pattern!r} has {groups}; make the others non-capturing: (?:...)")
        elif not str(section.json_path).strip("."):
            raise ValueError(f"{_key('json_path')} must name the score's key, e.g. score or verdict.score")
        score_range = None
        if section.score_range is not None:
            values = [float(v) for v in section.score_range]
            if len(values) != 2 or not all(math.isfinite(v) for v in values) or values[0] >= values[1]:
                raise ValueError(f"{_key('score_range')} must be [low, high] with low < high, or null for the "
                                 f"raw score; got {list(section.score_range)}")
            score_range = [values[0], values[1]]
        checks = [
            ("temperature", math.isfinite(section.temperature) and section.temperature >= 0, ">= 0"),
            ("max_tokens", section.max_tokens >= 1, "at least 1"),
            ("timeout_s", section.timeout_s > 0, "> 0"),
            ("retries", section.retries >= 0, ">= 0"),
            ("max_concurrency", section.max_concurrency >= 1, "at least 1"),
            ("combine", section.combine in COMBINE, f"one of {COMBINE}"),
            ("weight", math.isfinite(section.weight), "a finite number"),
            ("failure_score", section.failure_score is None or math.isfinite(section.failure_score),
             "null (fail the sample) or a finite number"),
            ("max_response_bytes", not isinstance(section.max_response_bytes, bool)
             and isinstance(section.max_response_bytes, int) and section.max_response_bytes >= 1024,
             "an integer of at least 1024 (bytes)"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{_key(name)} must be {expected}, got {getattr(section, name)!r}")
        keys = {f.name: getattr(section, f.name) for f in fields(JudgeSection)}
        return cls(**{**keys, "url": url, "prompt": prompt, "pattern": str(section.pattern),
                      "json_path": str(section.json_path), "score_range": score_range, "mode": mode,
                      "temperature": float(section.temperature), "max_tokens": int(section.max_tokens),
                      "timeout_s": float(section.timeout_s), "retries": int(section.retries),
                      "max_concurrency": int(section.max_concurrency), "weight": float(section.weight),
                      "failure_score": None if section.failure_score is None else float(section.failure_score),
                      "max_response_bytes": int(section.max_response_bytes)}, criteria=rubric)

    def render(self, values: Mapping[str, str]) -> str:
        """The prompt: the template filled from ``values`` (:func:`prompt_values`, or in group
        mode the group's) plus the rubric's ``criteria``."""
        template = _default_prompt(self.mode, self.criteria) if self.prompt is None else self.prompt
        return render_prompt(template, {**values, "criteria": criteria_text(self.criteria)})

    def parse_score(self, reply: str) -> float:
        """The score in the judge's ``reply``, mapped by :attr:`score_range`.

        Raises:
            ValueError: no score in the reply, it is not a finite number, or it is outside the range.
        """
        if self.parser == "regex":
            matches = re.findall(self.pattern, reply)
            if not matches:
                raise ValueError(f"no match of reward.judge.pattern {self.pattern!r}")
            raw: Any = matches[-1]
        else:
            value = last_json_object(reply)
            for part in self.json_path.strip(".").split("."):
                if not isinstance(value, Mapping) or part not in value:
                    raise ValueError(f"no JSON object with reward.judge.json_path {self.json_path!r}")
                value = value[part]
            raw = value
        return map_score(raw, self.score_range)

    def parse_verdict(self, reply: str) -> tuple[float, dict[str, float]]:
        """``(score, {criterion: its mapped score})`` of a single-mode reply: without a rubric
        :meth:`parse_score` and no parts; with one, the weighted mean of the criteria's scores
        in the reply's last JSON object (under ``scores``, or the object itself).

        Raises:
            ValueError: no score, or one that is not a number in the range.
        """
        if not self.criteria:
            return self.parse_score(reply), {}
        found = last_json_object(reply)
        if found is None:
            raise ValueError("no JSON object of criterion scores in the reply")
        scores = found.get("scores", found) if isinstance(found, Mapping) else found
        return rubric_score(scores, self.criteria, self.score_range)


def _default_prompt(mode: str, rubric: Sequence[Criterion]) -> str:
    if mode == GROUP:
        return DEFAULT_GROUP_RUBRIC_PROMPT if rubric else DEFAULT_GROUP_PROMPT
    return DEFAULT_RUBRIC_PROMPT if rubric else DEFAULT_PROMPT


def _check_prompt(prompt: str, mode: str, rubric: Sequence[Criterion]) -> None:
    """Raises ValueError naming ``reward.judge.prompt`` when the template cannot serve ``mode``
    and ``rubric``: a name it may not use, no trajectory shown, no criteria shown."""
    allowed = (*(GROUP_PLACEHOLDERS if mode == GROUP else PLACEHOLDERS), *(("criteria",) if rubric else ()))
    if mode == GROUP and "{response}" in prompt:
        raise ValueError(f"{_key('prompt')} names {{response}}, but {_key('mode')}=group shows the judge every "
                         "answer of the group at once: use {responses} (numbered answers) and {n} (how many)")
    check_template(prompt, allowed=allowed)
    shown = "{responses}" if mode == GROUP else "{response}"
    if shown not in prompt:
        raise ValueError(f"{_key('prompt')} never shows the judge the trajectory: put {shown} in it")
    if rubric and "{criteria}" not in prompt:
        raise ValueError(f"{_key('prompt')} never shows the judge {_key('rubric')}'s criteria: put {{criteria}} "
                         "in it (one '- name: description' line each; the judge replies with a score per name)")
