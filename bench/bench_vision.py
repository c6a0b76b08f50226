"""Benchmark: the cost of images in a rollout, against a text-only rollout of the same token count.

Two measurements on the tiny Qwen2-VL (``agentloop_engines.testing.tiny_vlm``), 224x224 images (64
image tokens each after the 2x2 merge):

* **Per turn, the processor path**: a trajectory appends a tool result holding one new image
  (PNG bytes, as a tool returns them: decode, the image processor, the placeholder expanded,
  the delta rendered and encoded) against a tool result of text with the same number of
  tokens. Median over turns of ``append_messages``; and the split of an image's cost (decode,
  image processor) measured on its own.
* **Rollout on HFServer**: 16 trajectories, each a prompt holding one image and a question,
  greedy 32 new tokens, against 16 text prompts of the same token count: wall time and
  generated tokens/s for the batch (the vision tower runs once per image at prefill). The
  image prompts run four ways, rounds alternated: as the engine did before (each image row
  prefilled on its own, ``HFServer.batch_image_prefill = False``, and the vision patch
  embedding as transformers' Conv3d), one by one with the patch embedding as a matmul
  (:func:`agentloop_engines.adapters.hf.vision.linear_patch_embeddings`), and in one batched forward
  with either patch embedding.

Run: ``python bench/bench_vision.py`` (writes ``bench/results/vision.json``).
"""

from __future__ import annotations

import asyncio
import io
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine, table, versions, write_result  # noqa: E402

TURNS = 16
ROWS = 16
NEW_TOKENS = 32
SIDE = 224
ROUNDS = 15


def _png(seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(SIDE, SIDE, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def per_turn(tokenizer, processor) -> dict[str, float]:
    from agentloop_core.protocol import TokenOutput
    from agentloop_core.tokenization import ChatRenderer, Trajectory
    from agentloop_core.vision import decode_image

    renderer = ChatRenderer(tokenizer, vision=processor)
    image_tokens = processor.process(decode_image(_png(0))).num_tokens
    filler = " ".join(["tool"] * image_tokens)  # about one token per word in the tiny tokenizer
    call = tokenizer.encode('<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call><|im_end|>',
                            add_special_tokens=False)
    pngs = [_png(1 + k) for k in range(TURNS)]
    times: dict[str, list[float]] = {"image": [], "text": []}
    sizes: dict[str, int] = {}
    for kind in ("image", "text"):
        for repeat in range(2):  # the first pass warms the template and piece caches
            t = Trajectory(renderer, [{"role": "user", "content": "Look at the pictures."}], sanity_check="strict")
            for k in range(TURNS):
                t.append_generated(TokenOutput(call, [0.0] * len(call)))
                content = ([{"type": "image", "image": pngs[k]}] if kind == "image"
                           else [{"type": "text", "text": filler}])
                start = time.perf_counter()
                ids = t.append_messages([{"role": "tool", "name": "look", "content": content}])
                if repeat:
                    times[kind].append(time.perf_counter() - start)
                    sizes[kind] = len(ids)
            t.to_output(sanity_check="strict")
    decode, process = [], []
    for png in pngs:
        start = time.perf_counter()
        image = decode_image(png)
        decode.append(time.perf_counter() - start)
        start = time.perf_counter()
        processor.process(image)
        process.append(time.perf_counter() - start)
    return {"image_ms": 1e3 * statistics.median(times["image"]), "text_ms": 1e3 * statistics.median(times["text"]),
            "image_delta_tokens": sizes["image"], "text_delta_tokens": sizes["text"],
            "decode_ms": 1e3 * statistics.median(decode), "process_ms": 1e3 * statistics.median(process)}


def rollout(path: Path, tokenizer, processor) -> dict[str, dict[str, float]]:
    from agentloop_core.tokenization import ChatRenderer, Trajectory
    from agentloop_core.vision import multi_modal_kwargs
    from agentloop_engines.adapters.hf.server import HFServer
    from agentloop_engines.adapters.hf.vision import linear_patch_embeddings

    server = HFServer(path, max_batch_size=ROWS)
    renderer = ChatRenderer(tokenizer, vision=processor)
    question = "What is in the picture?"
    with_images = [Trajectory(renderer, [{"role": "user", "content": [
        {"type": "image", "image": _png(100 + k)}, {"type": "text", "text": question}]}]) for k in range(ROWS)]
    n_image = len(with_images[0].prompt_ids)
    # Distinct text prompts (a repeated prompt would be prefilled once), each padded with words
    # to the image prompt's token count.
    text_rows = []
    for k in range(ROWS):
        words = f"picture {k}:"
        candidate = Trajectory(renderer, [{"role": "user", "content": words + " " + question}])
        while len(candidate.prompt_ids) < n_image:
            words += " picture"
            candidate = Trajectory(renderer, [{"role": "user", "content": words + " " + question}])
        text_rows.append(candidate)
    out: dict[str, dict[str, float]] = {}

    async def run(rows: list) -> float:
        start = time.perf_counter()
        await asyncio.gather(*[server.generate(f"r{k}", t.prompt_ids, {"max_tokens": NEW_TOKENS, "temperature": 0,
                                                                       "ignore_eos": True},
                                               **multi_modal_kwargs(t.image_items)) for k, t in enumerate(rows)])
        return time.perf_counter() - start

    # Alternated rounds, so drifting load on a shared machine hits every variant alike. The
    # first variant is the engine before batched image prefill and the patch matmul.
    variants = (("image_before", with_images, False, False), ("image_one_by_one", with_images, False, True),
                ("image_batched_conv", with_images, True, False), ("image_batched", with_images, True, True),
                ("text", text_rows, True, True))
    walls: dict[str, list[float]] = {name: [] for name, *_ in variants}

    def configure(batched: bool, patch_matmul: bool) -> None:
        server.batch_image_prefill = batched
        if patch_matmul:
            linear_patch_embeddings(server.model)
        else:
            for module in server.model.modules():
                vars(module).pop("forward", None)  # back to the class's Conv3d forward

    for _, rows, batched, patch_matmul in variants:
        configure(batched, patch_matmul)
        asyncio.run(run(rows[:2]))  # warm-up
    for _ in range(ROUNDS):
        for name, rows, batched, patch_matmul in variants:
            configure(batched, patch_matmul)
            walls[name].append(asyncio.run(run(rows)))
    for name, rows, *_ in variants:
        wall = statistics.median(walls[name])
        # The best round too: on a shared machine other work only ever adds time.
        out[name] = {"prompt_tokens": len(rows[0].prompt_ids), "wall_s": wall, "best_wall_s": min(walls[name]),
                     "tokens_per_s": ROWS * NEW_TOKENS / wall}
    return out


def main() -> None:
    import transformers

    from agentloop_core.vision import load_vision_processor
    from agentloop_engines.testing.tiny_vlm import build_tiny_vlm

    path = build_tiny_vlm()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    processor = load_vision_processor(path, tokenizer)
    load = load_average()
    turn = per_turn(tokenizer, processor)
    print(table(["tool result", "delta tokens", "append_messages (median ms)"],
                [["one 224x224 image (PNG bytes)", turn["image_delta_tokens"], f"{turn['image_ms']:.2f}"],
                 ["text, same token count", turn["text_delta_tokens"], f"{turn['text_ms']:.2f}"],
                 ["  of the image: decode", "", f"{turn['decode_ms']:.2f}"],
                 ["  of the image: image processor", "", f"{turn['process_ms']:.2f}"]],
                title=f"Per tool turn, {TURNS} turns (load {load})"))
    roll = rollout(path, tokenizer, processor)
    text_wall = roll["text"]["wall_s"]
    labels = {"image_before": "one by one, Conv3d patches (before)", "image_one_by_one": "one by one, patch matmul",
              "image_batched_conv": "one batch, Conv3d patches", "image_batched": "one batch, patch matmul (after)"}
    text_best = roll["text"]["best_wall_s"]
    rows = [[f"{ROWS} x one image + question", label, roll[key]["prompt_tokens"], f"{roll[key]['wall_s']:.3f}",
             f"{roll[key]['best_wall_s']:.3f}", f"{roll[key]['tokens_per_s']:.0f}",
             f"{roll[key]['wall_s'] / text_wall:.2f}x / {roll[key]['best_wall_s'] / text_best:.2f}x"]
            for key, label in labels.items()]
    rows.append([f"{ROWS} x distinct text, same length", "-", roll["text"]["prompt_tokens"], f"{text_wall:.3f}",
                 f"{text_best:.3f}", f"{roll['text']['tokens_per_s']:.0f}", "1.00x"])
    print(table(["prompts", "image prefill", "prompt tokens", "wall (s) median", "wall (s) best", "generated tok/s",
                 "vs text (median / best)"], rows,
                title=f"HFServer rollout, greedy {NEW_TOKENS} new tokens each, median of {ROUNDS} rounds"))
    write_result("vision", {"per_turn": turn, "rollout": roll, "machine": machine(), "load_average": load,
                            "versions": versions("torch", "transformers", "PIL")})


if __name__ == "__main__":
    main()
