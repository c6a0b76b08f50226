"""Can RL reach a template? How often a policy's sampled first turn calls the calculator with an
expression that gives the right answer, per template of the calculator task.

GRPO learns from groups whose samples disagree: a template whose first turn is never right at the
rollout temperature gives no group a signal, however many steps run. Greedy held-out accuracy does
not show this (a template at 0% greedy may be right in a fifth of its samples), so this samples
the first turn ``-k`` times for each of ``--problems`` fresh problems of each template (plain
``model.generate``, the checkpoint's own chat template with the calculator's schema), reads its
call with the rollout's tool parser and prints the share right, the share that made a usable
calculator call at all, and the most common expressions.

    python tools/first_turn_samples.py CHECKPOINT [--templates 4 8] [--temperature 1.0] [-k 16]
        [--tool-parser hermes]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import random
import re


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a Hugging Face folder (model and tokenizer with a tool-aware template)")
    parser.add_argument("--templates", type=int, nargs="+", default=None, help="template indices (default: all)")
    parser.add_argument("--problems", type=int, default=6, help="problems per template")
    parser.add_argument("-k", type=int, default=16, help="samples per problem")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the turn cap (the recipes use 48)")
    parser.add_argument("--seed", type=int, default=123)
    parser.add_argument("--tool-parser", default="hermes",
                        help="the parser the rollout reads calls with (both built-in *-hermes templates: hermes)")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentloop_core.parsers import get_tool_parser
    from agentloop_tools.builtin.calculator import CalculatorError, evaluate_expression
    from agentloop_trainer.task.calculator import TEMPLATES, make_problem, prompt_messages, tool_schemas

    if args.temperature <= 0:
        parser.error("--temperature must be > 0: this measures sampling (greedy is the held-out eval)")
    tool_parser = get_tool_parser(args.tool_parser)
    tools = {schema["function"]["name"]: schema for schema in tool_schemas()}
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    print("| template | right | made a call | most common expressions |\n|---|---|---|---|")
    for t in args.templates if args.templates is not None else range(len(TEMPLATES)):
        right = calls = 0
        shapes: collections.Counter[str] = collections.Counter()
        for i in range(args.problems):
            problem = make_problem(rng, t, i)
            text = tok.apply_chat_template(prompt_messages(problem), tools=list(tools.values()),
                                           add_generation_prompt=True, tokenize=False)
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                out = model.generate(ids.repeat(args.k, 1), do_sample=True, temperature=args.temperature, top_p=1.0,
                                     top_k=0, max_new_tokens=args.max_new_tokens)
            for row in out:
                turn = tok.decode(row[ids.shape[1]:], skip_special_tokens=not tool_parser.needs_special_tokens)
                parsed = tool_parser.parse(turn, tools, record=False)
                expression = next((c.arguments.get("expression") for c in parsed.calls if c.name == "calculator"), None)
                if not isinstance(expression, str):
                    continue
                calls += 1
                shapes[re.sub(r"\d+", "n", expression)] += 1
                with contextlib.suppress(CalculatorError):  # the rollout's own calculator: bounded
                    right += evaluate_expression(expression) == problem.answer
        n = args.problems * args.k
        print(f"| {t} | {right}/{n} | {calls}/{n} | {json.dumps(dict(shapes.most_common(3)))} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
