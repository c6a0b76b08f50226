"""Batched decoding with a KV cache: left-padded prefill, per-row stops, and admission of new
rows into a running batch.

Each row finishes on its own (stop token, budget, abort) and is handed back the moment it does,
so a short request never waits for the longest one in its batch; finished rows are dropped from
the KV cache so later steps only compute live rows. Requests that arrive mid-batch are
prefilled on their own and merged in (their cache left-padded with masked slots), so a long
request does not hold newcomers back. A prompt repeated within one prefill (the samples of a
GRPO group, with the same images) is computed once and its cache copied to each of its rows.
Prompts with images prefill in one forward with the rows that arrived with them
(:meth:`DecodeBatch.prefill_images`), falling back to one forward per image row only when that
forward fails, so a broken image fails its own request alone.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from agentloop_core.protocol import SamplingParams, StopReason, TokenOutput
from agentloop_core.vision.processor import ImageItem, image_token_runs
from agentloop_engines.adapters.hf.growing_cache import grow_in_place, left_pad, merge_layers
from agentloop_engines.adapters.hf.prefix_cache import Hit, PrefixCache, hit_inputs
from agentloop_engines.adapters.hf.sampling import RowSampling, sample_rows
from agentloop_engines.adapters.hf.vision import prefill_inputs

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Row:
    """One request inside the engine."""

    request_id: str
    """The caller's request id; ``abort`` matches on it."""
    prompt_ids: list[int]
    """Validated prompt ids."""
    sp: SamplingParams
    """Validated, context-clamped sampling parameters."""
    sampling: RowSampling
    """Prepared per-row sampler settings (temperature, filters, RNG)."""
    stop_ids: frozenset[int]
    """Ids that end this row: the request's stop ids plus EOS unless ``ignore_eos``."""
    on_done: Callable[[TokenOutput], object]
    """Called exactly once with the result (from the worker thread or the event loop)."""
    on_error: Callable[[BaseException], object]
    """Called instead of ``on_done`` when the engine fails while serving this row."""
    token_ids: list[int] = field(default_factory=list)
    """Tokens generated so far."""
    log_probs: list[float] = field(default_factory=list)
    """Log-prob of each generated token."""
    aborted: bool = False
    """Set by ``abort``; the decode loop checks it every step."""
    done: bool = False
    """True once ``on_done`` has been called."""
    on_token: Callable[[int, float], object] | None = None
    """A streamed request's callback (from the worker thread) with each token as it is sampled;
    None for a request answered whole, which then costs nothing extra."""
    images: tuple[ImageItem, ...] = ()
    """The images whose tokens the prompt holds, in order (prefilled by :meth:`DecodeBatch.prefill_images`)."""

    def fail(self, exc: BaseException) -> None:
        if not self.done:
            self.done = True
            self.on_error(exc)

    def finish(self, reason: StopReason) -> None:
        if self.done:
            return
        self.done = True
        self.on_done(
            TokenOutput(
                token_ids=list(self.token_ids),
                log_probs=list(self.log_probs) if self.sp.logprobs else None,
                stop_reason=reason,
            )
        )


class DecodeBatch:
    """Rows decoding together: their KV cache, attention mask, next positions and the last
    sampled token of each row (not yet fed to the model).

    Build one with :meth:`prefill`, advance it with :meth:`step`, and admit requests that
    arrived meanwhile with :meth:`merge`. Every method runs torch work and belongs in a worker
    thread.
    """

    def __init__(self, rows: list[Row], cache: Any, mask: torch.Tensor, next_pos: torch.Tensor,
                 last: torch.Tensor) -> None:
        self.rows = rows
        self.cache = cache
        self.mask = mask
        self.next_pos = next_pos
        self.last = last
        self.prefix_cache: PrefixCache | None = None
        """Where rows that finish by stop or length leave their keys and values (None: nowhere)."""

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def prefill(cls, model: Any, rows: list[Row], *, pad_id: int, device: torch.device,
                stats: dict[str, int]) -> DecodeBatch | None:
        """Run the left-padded prompts and sample each row's first token.

        Returns:
            The rows still generating, or None when every row already finished.
        """
        live = _live(rows)
        if not live:
            return None
        # Samples of one prompt (a GRPO group) arrive together: prefill each distinct prompt once
        # and give every row a copy of its prompt's cache and last logits.
        distinct: dict[tuple[int, ...], int] = {}
        owner = [distinct.setdefault(tuple(r.prompt_ids), len(distinct)) for r in live]
        prompts = [list(p) for p in distinct]
        with torch.inference_mode():
            prefix = _shared_prefix_length(prompts) if len(prompts) > 1 else 0
            if prefix < MIN_SHARED_PREFIX:
                prefix = 0
            width = max(len(p) for p in prompts) - prefix
            ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for i, p in enumerate(prompts):
                tail = p[prefix:]
                ids[i, width - len(tail) :] = torch.tensor(tail, dtype=torch.long)
                mask[i, width - len(tail) :] = 1
            ids, mask = ids.to(device), mask.to(device)
            kw: dict[str, Any] = {}
            if prefix:
                # Rows sharing a prompt prefix (system turn, tool schemas) compute it once and
                # share its key/value cache: a pad gap may sit between prefix and tail, masked.
                head = model(input_ids=ids.new_tensor([prompts[0][:prefix]]), use_cache=True,
                             logits_to_keep=1)
                cache = _cache_of(head)
                cache.batch_repeat_interleave(len(prompts))
                grow_in_place(cache)  # the tails' keys go into a buffer with room for the decode steps
                kw[_cache_kwarg(type(model))] = cache
                mask = torch.cat([mask.new_ones((len(prompts), prefix)), mask], dim=-1)
            # Positions count real tokens only, so a left-padded row sees the positions it would
            # see alone (RoPE models would not notice an offset; absolute-position models would).
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, prefix:]
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        logits_to_keep=1, **kw)
            _count(stats, len(prompts), prefill_tokens=int(mask[:, prefix:].sum()) + prefix)
            stats["shared_prefix_tokens"] += prefix * (len(prompts) - 1)
            cache, logits = _cache_of(out), out.logits[:, -1]
            grow_in_place(cache)  # decode steps write into spare room instead of copying the cache
            if len(prompts) < len(live):
                stats["repeated_prompt_tokens"] += sum(len(r.prompt_ids) for r in live) - sum(map(len, prompts))
                owners = torch.tensor(owner, device=mask.device)
                cache.batch_select_indices(owners)
                mask, logits = mask[owners], logits[owners]
            batch = cls(live, cache, mask, mask.sum(-1), torch.empty(0))
            return batch._sample(logits, stats)

    @classmethod
    def prefill_all(cls, model: Any, rows: list[Row], *, pad_id: int, device: torch.device, stats: dict[str, int],
                    image_token_id: int | None, batch_images: bool = True,
                    prefix_cache: PrefixCache | None = None) -> DecodeBatch | None:
        """Prefill new rows. Text prompts alone go together through :meth:`prefill`. With prompts
        holding images among them, every row goes into one :meth:`prefill_images` forward (a
        prompt whose image tokens do not match its images fails alone first); if that forward
        raises, or ``batch_images`` is False, each image row is prefilled on its own (a failure
        there fails that row alone) and the text rows together. With a ``prefix_cache``, text rows
        whose trajectory's last turn it holds prefill only their new tokens (:meth:`prefill_hits`).

        Returns:
            One batch of the rows still generating, or None.
        """
        if prefix_cache is not None:
            return cls._prefill_cached(model, rows, prefix_cache, pad_id=pad_id, device=device, stats=stats,
                                       image_token_id=image_token_id, batch_images=batch_images)
        imaged = [r for r in rows if r.images]
        if not imaged:
            return cls.prefill(model, rows, pad_id=pad_id, device=device, stats=stats)
        if image_token_id is None:  # the engine refuses images for a text model before a row gets here
            for row in imaged:
                row.fail(ValueError("a request with images reached a model without an image token id"))
            return cls.prefill(model, [r for r in rows if not r.images], pad_id=pad_id, device=device, stats=stats)
        if batch_images:
            valid = [r for r in rows if _images_match(r, image_token_id)]
            try:
                return cls.prefill_images(model, valid, token_id=image_token_id, pad_id=pad_id, device=device,
                                          stats=stats)
            except Exception as exc:  # noqa: BLE001 - retried row by row below, so a failure reaches its own row
                stats["image_prefill_fallbacks"] += 1
                logger.warning("batched prefill of %d rows with images failed (%s: %s); prefilling them one by one",
                               len(valid), type(exc).__name__, exc)
                rows = [r for r in valid if not r.done]
                imaged = [r for r in rows if r.images]
        text = [r for r in rows if not r.images]
        batches = [cls.prefill(model, text, pad_id=pad_id, device=device, stats=stats) if text else None]
        for row in imaged:
            try:
                batches.append(cls.prefill_images(model, [row], token_id=image_token_id, pad_id=pad_id,
                                                  device=device, stats=stats))
            except Exception as exc:  # noqa: BLE001 - delivered to this row's caller
                row.fail(exc)
        merged: DecodeBatch | None = None
        for batch in batches:
            if batch is not None:
                merged = batch if merged is None else merged.merge(batch)
        return merged

    @classmethod
    def _prefill_cached(cls, model: Any, rows: list[Row], prefix_cache: PrefixCache, *, pad_id: int,
                        device: torch.device, stats: dict[str, int], image_token_id: int | None,
                        batch_images: bool) -> DecodeBatch | None:
        """Rows with a cached prefix through :meth:`prefill_hits`, the rest as without a cache;
        the batch keeps finished rows' keys and values in ``prefix_cache``."""
        hits: list[Hit] = []
        cold: list[Row] = []
        for row in _live(rows):
            hit = prefix_cache.take(row)
            if hit is None:
                cold.append(row)
            else:
                hits.append(hit)
        batches = [cls.prefill_hits(model, hits, pad_id=pad_id, device=device, stats=stats,
                                    prefix_cache=prefix_cache) if hits else None]
        if cold:
            batches.append(cls.prefill_all(model, cold, pad_id=pad_id, device=device, stats=stats,
                                           image_token_id=image_token_id, batch_images=batch_images))
        merged: DecodeBatch | None = None
        for batch in batches:
            if batch is not None:
                batch.prefix_cache = prefix_cache
                merged = batch if merged is None else merged.merge(batch)
        return merged

    @classmethod
    def prefill_hits(cls, model: Any, hits: list[Hit], *, pad_id: int, device: torch.device, stats: dict[str, int],
                     prefix_cache: PrefixCache) -> DecodeBatch | None:
        """Prefill only the new tokens of rows whose prompts start with a cached prefix, the
        cached keys and values as the past (:func:`agentloop_engines.adapters.hf.prefix_cache.hit_inputs`),
        and sample each row's first token."""
        with torch.inference_mode():
            kw = hit_inputs(hits, pad_id=pad_id, device=device)
            width, next_pos = kw.pop("reused_width"), kw.pop("next_pos")
            past = kw.pop("cache")
            grow_in_place(past)  # the new tokens' keys go into a buffer with room for the decode steps
            kw[_cache_kwarg(type(model))] = past
            out = model(**kw, use_cache=True, logits_to_keep=1)
            mask = kw["attention_mask"]
            _count(stats, len(hits), prefill_tokens=int(mask[:, width:].sum()))
            cache = _cache_of(out)
            grow_in_place(cache)
            batch = cls([h.row for h in hits], cache, mask, next_pos, torch.empty(0))
            batch.prefix_cache = prefix_cache
            return batch._sample(out.logits[:, -1], stats)

    @classmethod
    def prefill_images(cls, model: Any, rows: list[Row], *, token_id: int, pad_id: int, device: torch.device,
                       stats: dict[str, int]) -> DecodeBatch | None:
        """Prefill rows whose prompts may hold images in one left-padded forward (their vision
        features, and 3-D positions for an M-RoPE model; :func:`agentloop_engines.adapters.hf.vision.prefill_inputs`)
        and sample each row's first token. Rows with the same prompt and images (a GRPO group's
        samples) are computed once. The batch it returns merges with any other.

        Returns:
            The rows still generating, or None when every row already finished.
        """
        live = _live(rows)
        if not live:
            return None
        index: dict[tuple[tuple[int, ...], tuple[str, ...]], int] = {}
        owner = [index.setdefault(_prompt_key(r), len(index)) for r in live]
        unique = [live[owner.index(k)] for k in range(len(index))]
        with torch.inference_mode():
            kwargs, next_positions = prefill_inputs(model, [r.prompt_ids for r in unique], [r.images for r in unique],
                                                    token_id, pad_id=pad_id, device=device)
            out = model(**kwargs, use_cache=True, logits_to_keep=1)
            _count(stats, len(unique), prefill_tokens=sum(len(r.prompt_ids) for r in unique))
            cache, logits, mask = _cache_of(out), out.logits[:, -1], kwargs["attention_mask"]
            grow_in_place(cache)
            # A row's next position is past its highest (M-RoPE: below its length); a decode step's
            # 2-D position is the same on all three axes, as the model's own decode makes it.
            next_pos = torch.tensor(next_positions, device=device)
            if len(unique) < len(live):
                stats["repeated_prompt_tokens"] += sum(len(r.prompt_ids) for r in live) - sum(
                    len(r.prompt_ids) for r in unique)
                owners = torch.tensor(owner, device=mask.device)
                cache.batch_select_indices(owners)
                mask, logits, next_pos = mask[owners], logits[owners], next_pos[owners]
            batch = cls(live, cache, mask, next_pos, torch.empty(0))
            return batch._sample(logits, stats)

    def step(self, model: Any, stats: dict[str, int]) -> DecodeBatch | None:
        """Feed the last sampled tokens, sample the next ones, drop rows that finished.

        Returns:
            This batch, or None when no row is left.
        """
        with torch.inference_mode():
            self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=-1)
            out = model(
                input_ids=self.last[:, None],
                attention_mask=self.mask,
                position_ids=self.next_pos[:, None],
                use_cache=True,
                **{_cache_kwarg(type(model)): self.cache},
            )
            _count(stats, len(self.rows))
            self.cache = _cache_of(out)
            self.next_pos = self.next_pos + 1
            return self._sample(out.logits[:, -1], stats)

    def _sample(self, logits: torch.Tensor, stats: dict[str, int]) -> DecodeBatch | None:
        errors: list[Exception | None] = [None] * len(self.rows)
        try:
            tokens, lps = sample_rows(logits, [r.sampling for r in self.rows])
        except Exception:  # noqa: BLE001 - narrowed to the rows that raise, below
            tokens, lps, errors = self._sample_each(logits)
        tok_list, lp_list = tokens.tolist(), lps.tolist()
        keep: list[int] = []
        finished: list[int] = []
        for j, r in enumerate(self.rows):
            if r.aborted:
                r.finish("aborted")
                continue
            error = errors[j]
            if error is not None:
                r.fail(error)
                continue
            tok = tok_list[j]
            r.token_ids.append(tok)
            r.log_probs.append(lp_list[j])
            stats["generated_tokens"] += 1
            if r.on_token is not None:
                r.on_token(tok, lp_list[j])
            if tok in r.stop_ids or len(r.token_ids) >= r.sp.max_tokens:
                finished.append(j)
            else:
                keep.append(j)
        if finished and self.prefix_cache is not None:
            # Before the callers hear: a trajectory's next turn finds its entry.
            self.prefix_cache.store(self.rows, self.cache, self.mask, finished)
        for j in finished:
            self.rows[j].finish("stop" if self.rows[j].token_ids[-1] in self.rows[j].stop_ids else "length")
        if not keep:
            return None
        if len(keep) < len(self.rows):
            # Dropping finished rows from the cache keeps later steps to live rows only. The last
            # live rows take the finished rows' places, so the cache moves only those rows in place.
            keep = _fill_from_the_end(keep)
            sel = torch.tensor(keep, device=self.mask.device)
            self.cache.batch_select_indices(sel)
            self.mask, self.next_pos, tokens = self.mask[sel], self.next_pos[sel], tokens[sel]
            self.rows = [self.rows[j] for j in keep]
        self.last = tokens
        return self

    def _sample_each(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[Exception | None]]:
        """Sample row by row after the batched call raised, so one request's bad settings (or a
        sampler bug it triggers) fail that request alone instead of every row in the batch."""
        tokens = torch.zeros(len(self.rows), dtype=torch.long, device=logits.device)
        lps = torch.zeros(len(self.rows), dtype=torch.float32, device=logits.device)
        errors: list[Exception | None] = []
        for j, r in enumerate(self.rows):
            try:
                tok, lp = sample_rows(logits[j : j + 1], [r.sampling])
            except Exception as exc:  # noqa: BLE001 - delivered to this row's caller
                errors.append(exc)
                continue
            tokens[j], lps[j] = tok[0], lp[0]
            errors.append(None)
        return tokens, lps, errors

    def can_merge(self) -> bool:
        """Whether :meth:`merge` knows this cache layout (plain full-attention DynamicCache)."""
        layers = getattr(self.cache, "layers", None)
        return bool(layers) and all(type(layer).__name__ in ("DynamicLayer", "GrowingLayer") for layer in layers)

    def merge(self, other: DecodeBatch) -> DecodeBatch:
        """Append ``other``'s rows, left-padding the shorter KV cache with masked slots."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        with torch.inference_mode():
            for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
                merge_layers(mine, theirs, width)
            self.mask = torch.cat([left_pad(self.mask, width, dim=1), left_pad(other.mask, width, dim=1)])
            self.next_pos = torch.cat([self.next_pos, other.next_pos])
            self.last = torch.cat([self.last, other.last])
        self.rows = self.rows + other.rows
        if self.prefix_cache is None:  # a PrefixCache with no entry is falsy: compare to None
            self.prefix_cache = other.prefix_cache
        return self

    def abort_all(self, exc: BaseException | None = None) -> None:
        for r in self.rows:
            if exc is None:
                r.finish("aborted")
            else:
                r.fail(exc)


def _fill_from_the_end(keep: list[int]) -> list[int]:
    """The rows ``keep`` names (ascending), reordered so that each row below ``len(keep)`` stays
    where it is and the rest fill, from the end, the places of rows that are gone: every kept
    row stays or moves down, and only the rows that must move do."""
    n = len(keep)
    staying = {j for j in keep if j < n}
    movers = [j for j in keep if j >= n]
    return [i if i in staying else movers.pop() for i in range(n)]


def _live(rows: list[Row]) -> list[Row]:
    """The rows still to prefill; an aborted one is finished here."""
    live = []
    for r in rows:
        if r.aborted:
            r.finish("aborted")
        elif not r.done:
            live.append(r)
    return live


def _prompt_key(row: Row) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Rows with equal keys prefill to the same cache: the prompt and its images' pixels."""
    return tuple(row.prompt_ids), tuple(item.digest for item in row.images)


def _images_match(row: Row, token_id: int) -> bool:
    """Whether the row's image tokens are its images' runs; a row whose are not fails here, alone."""
    if row.aborted or row.done:
        return True  # finished by the prefill, without an error
    try:
        image_token_runs(row.prompt_ids, row.images, token_id)
    except ValueError as exc:
        row.fail(exc)
        return False
    return True


MIN_SHARED_PREFIX = 16
"""Shortest common prompt prefix worth a separate forward pass at prefill."""


def _shared_prefix_length(prompts: list[list[int]]) -> int:
    """Longest prefix all prompts share, leaving each at least one token of its own (the
    last prompt token's logits pick the first generated token)."""
    first, limit = prompts[0], min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


@functools.cache
def _cache_kwarg(model_cls: type) -> str:
    # transformers 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns, and goes
    # in 5.40); older 5.x releases (e.g. 5.17 on the GPU machine) only know the old name.
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def _cache_of(out: Any) -> Any:
    return out["cache"] if "cache" in out else out["past_key_values"]


def _count(stats: dict[str, int], rows: int, prefill_tokens: int = 0) -> None:
    stats["forward_calls"] += 1
    stats["batched_rows"] += rows
    stats["max_batch_rows"] = max(stats["max_batch_rows"], rows)
    stats["prefill_tokens"] += prefill_tokens
