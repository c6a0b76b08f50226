"""Datasets as parquet rows: raw chat ``prompt``, ``agent_name``, ``data_source``,
``reward_model.ground_truth`` and ``extra_info.tools_kwargs`` (verl's layout)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentloop_core.vision.content import IMAGE_PART_TYPES, messages_with_row_images
from agentloop_trainer.data.image_lengths import has_images, image_prompt_lengths, template_length


def write_parquet_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write rows to a parquet file."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def normalize_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as text: a string, or a list of ``{"type": "text", "text": ...}``
    parts (OpenAI's list form) joined in order. A list that holds image parts (``image``,
    ``image_url``, ``input_image``) is kept as parts (absent fields dropped), for the loop's
    vision processor.

    Raises:
        ValueError: a part that is neither text nor an image, naming ``where``.
    """
    if isinstance(content, (list, tuple)) and any(isinstance(p, Mapping) and p.get("type") in IMAGE_PART_TYPES
                                                  for p in content):
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind not in IMAGE_PART_TYPES and (kind != "text" or not isinstance(part.get("text"), str)):
                raise ValueError(f"{where} content part {k} is {kind!r}; text and image parts are supported")
            parts.append({key: v for key, v in dict(part).items() if v is not None})
        return parts
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, (list, tuple)) or (hasattr(content, "__len__") and not isinstance(content, Mapping)):
        texts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where} content part {k} is {kind!r}; only text parts "
                                 "({'type': 'text', 'text': ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"{where} content must be a string or a list of text parts, got {type(content).__name__}")


def normalize_messages(messages: Sequence[Mapping[str, Any]], where: str = "prompt",
                       images: Sequence[Any] | None = None) -> list[dict[str, Any]]:
    """Chat messages with text content (or text and image parts), keys whose value is None
    dropped (parquet fills absent struct fields with None, which chat templates would render).

    Args:
        messages: The row's prompt.
        where: What it is, for errors.
        images: The row's images column (verl's layout): each ``<image>`` marker in the text
            becomes an image part holding the next image (decoded later, once, by the loop).
    """
    if images is not None and len(images):
        messages = messages_with_row_images(messages, list(images), where=where)
    out = []
    for k, m in enumerate(messages):
        msg = {key: v for key, v in dict(m).items() if v is not None}
        msg["content"] = normalize_content(m.get("content"), f"{where} message {k}")
        out.append(msg)
    return out


def check_row(row: Any, need_ground_truth: bool = True) -> str | None:
    """Why ``row`` is not a usable dataset row, or None when it is. Message content may be a
    string or a list of text parts; ``reward_model.ground_truth`` is needed unless the reward
    comes from the loop alone."""
    if not isinstance(row, dict):
        return "is not a mapping"
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return "'prompt' must be a non-empty list of chat messages"
    for k, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m.get("content") is None:
            return f"prompt message {k} needs a string 'role' and 'content' (a string or a list of text parts)"
        try:
            normalize_content(m.get("content"), f"prompt message {k}")
        except ValueError as exc:
            return str(exc)
    rm = row.get("reward_model")
    if rm is not None and not isinstance(rm, dict):
        return "'reward_model' must be a mapping with 'ground_truth'"
    if need_ground_truth and (not isinstance(rm, dict) or rm.get("ground_truth") in (None, "")):
        return ("'reward_model.ground_truth' is missing (needed by the reward function; with rewards from "
                "the loop's tools alone set reward.source=loop)")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        return "'extra_info' must be a mapping"
    if isinstance(extra, dict) and not isinstance(extra.get("tools_kwargs") or {}, dict):
        return "'extra_info.tools_kwargs' must be a mapping of tool name -> kwargs"
    return None


def read_parquet_files(paths: Any, key: str, need_ground_truth: bool = True,
                       image_key: str = "images") -> list[dict[str, Any]]:
    """Rows of one parquet file or a list of them (verl's ``data.train_files`` forms), in order.

    Raises:
        FileNotFoundError / ValueError: as :func:`read_parquet_rows`, naming the file.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise ValueError(f"{key} is an empty list; give one parquet file or a list of them")
    rows: list[dict[str, Any]] = []
    for path in paths:
        rows.extend(read_parquet_rows(path, need_ground_truth=need_ground_truth, image_key=image_key))
    return rows


def read_parquet_rows(path: str | Path, need_ground_truth: bool = True, image_key: str = "images") -> list[dict[str, Any]]:
    """Rows of a parquet dataset as plain Python dicts and lists, every row checked. A row's
    ``image_key`` column (verl's multimodal rows) moves into its prompt as image parts.

    Raises:
        FileNotFoundError: naming the path.
        ValueError: when required columns are missing or rows are malformed (row numbers
            and reasons named, up to 20).
    """
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist; create it with `agentloop data gsm8k --out DIR ...`")
    rows = pq.read_table(path).to_pylist()
    if not rows:
        raise ValueError(f"{path} has no rows")
    required = {"prompt", "reward_model"} if need_ground_truth else {"prompt"}
    if not required <= set(rows[0]):
        raise ValueError(f"{path} lacks columns {sorted(required - set(rows[0]))}; expected verl-style rows "
                         "(prompt, data_source, reward_model.ground_truth, extra_info)")
    bad = [(i, why) for i, row in enumerate(rows) if (why := check_row(row, need_ground_truth)) is not None]
    if bad:
        listed = "; ".join(f"row {i}: {why}" for i, why in bad[:20])
        more = f" (and {len(bad) - 20} more)" if len(bad) > 20 else ""
        raise ValueError(f"{path}: {len(bad)} of {len(rows)} rows are malformed: {listed}{more}")
    for i, row in enumerate(rows):
        # Text parts joined, absent struct fields (None) dropped: what the chat template renders.
        row["prompt"] = normalize_messages(row["prompt"], f"{path} row {i} prompt", images=row.pop(image_key, None))
    return rows


def prompt_lengths(rows: Sequence[dict[str, Any]], tokenizer: Any, tools: list[dict[str, Any]] | None,
                   processor: Any = "auto", name: str = "dataset", image_limits: Any = None) -> list[int]:
    """Tokens of each row's prompt as the rollout renders it: the chat template with the
    rollout's tool schemas and the generation prompt, and each image as the run of image
    tokens the model's vision processor makes of it (not the template's one placeholder).

    Rows without images are measured with the tokenizer's chat template alone, as fast as a
    text-only dataset; rows with images (:mod:`.image_lengths`) through the rollout's renderer.

    Args:
        rows: Rows as :func:`read_parquet_rows` gives them.
        tokenizer: The run's tokenizer.
        tools: The rollout's tool schemas.
        processor: The model's vision processor; ``"auto"``: loaded, when a row has images,
            from the tokenizer's folder, as the rollout loads it; None: a text-only model.
        name: What the rows are, for errors.
        image_limits: The rollout's :class:`~agentloop_core.vision.ImageLimits` (None: the defaults).

    Raises:
        ValueError: rows with images for a text-only model, or images the rollout could not
            render (unreadable, over a limit), rows named.
    """
    lengths = []
    with_images: dict[int, list[dict[str, Any]]] = {}
    for i, row in enumerate(rows):
        if has_images(row["prompt"]):
            with_images[i] = list(row["prompt"])
            lengths.append(0)
            continue
        lengths.append(template_length(tokenizer, row["prompt"], tools))
    if with_images:
        for i, n in image_prompt_lengths(with_images, tokenizer, tools, processor, name, image_limits).items():
            lengths[i] = n
    return lengths


def limit_prompt_length(rows: Sequence[dict[str, Any]], tokenizer: Any, tools: list[dict[str, Any]] | None,
                        max_prompt_length: int, filter_overlong: bool, name: str = "dataset",
                        processor: Any = "auto", image_limits: Any = None) -> tuple[list[dict[str, Any]], int]:
    """Drop (``filter_overlong``) or reject prompts longer than ``max_prompt_length`` tokens,
    measured by :func:`prompt_lengths` (images as their image tokens; ``processor`` and
    ``image_limits`` as there).

    Returns:
        ``(kept rows, number dropped)``.

    Raises:
        ValueError: ``filter_overlong`` is false and a prompt is too long (row and length named);
            as :func:`prompt_lengths`.
    """
    lengths = prompt_lengths(rows, tokenizer, tools, processor, name, image_limits)
    over = [(i, n) for i, n in enumerate(lengths) if n > max_prompt_length]
    if over and not filter_overlong:
        listed = ", ".join(f"row {i} ({n} tokens)" for i, n in over[:10])
        raise ValueError(
            f"{name}: {len(over)} prompts exceed data.max_prompt_length={max_prompt_length} with the tool "
            f"schemas rendered: {listed}; raise data.max_prompt_length or set data.filter_overlong_prompts=true"
        )
    drop = {i for i, _ in over}
    return [r for i, r in enumerate(rows) if i not in drop], len(drop)
