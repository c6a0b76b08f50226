"""Step (d) of the GPU check: HFServer against plain transformers ``generate`` on one device.

On the tiny Qwen2 (``initializer_range=0.3``, as the engines' tests use, so greedy outputs
depend on the prompt), both greedy-decode the same prompts for a fixed number of tokens (EOS
ignored). Checked: the tokens are equal, and the largest gap between HFServer's log-probs and
the log-softmax of ``generate``'s raw logits is under ``LOGPROB_TOL``. Measured: tokens/s of
``generate`` one prompt at a time, of HFServer one at a time, and of HFServer given every
prompt at once (its continuous batching), each after one untimed warm-up.

    python tools/gpu_check/hf_vs_generate.py [--device cuda] [--max-tokens 64] [--model DIR]

Prints one ``GPU_CHECK_NUMBERS {json}`` line; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import torch
import transformers

from agentloop_engines.adapters.hf import HFServer
from agentloop_engines.testing.tiny_model import build_tiny_model

LOGPROB_TOL = 1e-3
"""Largest per-token log-prob gap allowed (the engines' CUDA test uses the same bound)."""
PROMPTS = [[100, 200, 300], [5, 6, 7, 8, 9, 10, 11, 12, 13], [42], [400, 401, 402, 403, 404],
           [7, 70, 170, 270], [1, 2, 3, 4], [300, 301], [33, 44, 55, 66, 77, 88]]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_generate(model: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy ``generate`` with no stop token: its tokens and each one's log-prob (raw logits)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.cat([step.float() for step in out.logits], dim=0)
    log_probs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens, device=logits.device)[:, None])
    return tokens, log_probs[:, 0].tolist()


async def server_outputs(server: HFServer, max_tokens: int, batched: bool) -> list[Any]:
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if batched:
        return list(await asyncio.gather(*(server.generate(f"b{i}", p, params) for i, p in enumerate(PROMPTS))))
    return [await server.generate(f"s{i}", p, params) for i, p in enumerate(PROMPTS)]


def compare(model_dir: str, device_name: str, max_tokens: int) -> dict[str, Any]:
    device = torch.device(device_name)
    # Any: transformers' annotation of PreTrainedModel.to rejects a torch.device.
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device).eval()
    # No stop token: both sides decode exactly max_tokens (HFServer's ignore_eos).
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        plain_generate(model, PROMPTS[0], 4)  # warm-up (CUDA context, kernels)
        _sync(device)
        start = time.perf_counter()
        reference = [plain_generate(model, p, max_tokens) for p in PROMPTS]
        _sync(device)
        generate_s = time.perf_counter() - start

    async def serve() -> tuple[list[Any], list[Any], float, float]:
        server = HFServer(model_dir, device=device_name, max_batch_size=32)
        try:
            await server.generate("warm", PROMPTS[0], {"max_tokens": 4, "temperature": 0, "ignore_eos": True})
            start = time.perf_counter()
            alone = await server_outputs(server, max_tokens, batched=False)
            alone_s = time.perf_counter() - start
            start = time.perf_counter()
            together = await server_outputs(server, max_tokens, batched=True)
            together_s = time.perf_counter() - start
        finally:
            await server.close()
        return alone, together, alone_s, together_s

    alone, together, alone_s, together_s = asyncio.run(serve())
    tokens = len(PROMPTS) * max_tokens
    mismatched = [i for i, (ref, a, b) in enumerate(zip(reference, alone, together, strict=True))
                  if not (ref[0] == list(a.token_ids) == list(b.token_ids))]
    gap = max(abs(x - y) for outs in (alone, together) for ref, out in zip(reference, outs, strict=True)
              for x, y in zip(ref[1], out.log_probs, strict=True))
    return {
        "device": device_name, "prompts": len(PROMPTS), "max_tokens": max_tokens,
        "greedy_equal": not mismatched, "mismatched_prompts": mismatched,
        "max_logprob_gap": gap, "logprob_tol": LOGPROB_TOL,
        "generate_tokens_per_s": round(tokens / generate_s, 1),
        "hfserver_sequential_tokens_per_s": round(tokens / alone_s, 1),
        "hfserver_batched_tokens_per_s": round(tokens / together_s, 1),
        "transformers": transformers.__version__, "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=str(__doc__).splitlines()[0])
    parser.add_argument("--device", default="cuda", help="torch device both sides run on (default cuda)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each prompt decodes (default 64)")
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: the tiny Qwen2 at init 0.3)")
    args = parser.parse_args(argv)
    model_dir = args.model or str(build_tiny_model(initializer_range=0.3))
    numbers = compare(model_dir, args.device, args.max_tokens)
    print("GPU_CHECK_NUMBERS " + json.dumps(numbers), flush=True)
    failures = []
    if not numbers["greedy_equal"]:
        failures.append(f"greedy tokens differ from generate's on prompts {numbers['mismatched_prompts']}")
    if numbers["max_logprob_gap"] > LOGPROB_TOL:
        failures.append(f"log-prob gap {numbers['max_logprob_gap']:.2e} > {LOGPROB_TOL:.0e}")
    for failure in failures:
        print(f"FAIL: HFServer on {args.device}: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
