"""The real-model recipe's held-out evaluation against a remote HFServer, told or not told when
each trajectory ends (``POST /forget_session``; bench/README 10i).

The trainer's own path: ``evaluate_checkpoint`` with ``actor_rollout_ref.rollout.server_urls``
naming an engine server (a ``ServerThread`` in this process, so its HFServer's counters can be
read) over the recipe's SFT checkpoint, in the dtype the recipe's engine runs in
(``rollout.dtype: model``) and with its batch (``rollout.max_batch_size``). "Not told": the same
HFServer behind a wrapper declaring no ``forget_session``, so ``/health`` does not offer it and
the client sends nothing, as before the route. Reported per side: second-turn hits and misses,
evictions, entries forgotten, entries left when the evaluation is over, accuracy and time.

Run: ``python bench/bench_forget_recipe_eval.py --model <the recipe's SFT checkpoint>`` (~1 min a
side on a 2-core CPU); writes ``bench/results/forget_recipe_eval.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, load_average, versions, write_result  # noqa: E402
from bench_forget_http import alternate, sides_table  # noqa: E402

from agentloop_core.protocol import ServerCapabilities  # noqa: E402
from agentloop_core.server_wrapper import TransparentServerWrapper  # noqa: E402

RECIPE = REPO_ROOT / "examples" / "trainer" / "smollm2_calculator.yaml"


class Silent(TransparentServerWrapper):
    """The engine, declaring no ``forget_session`` (a server before the route)."""

    @property
    def capabilities(self) -> ServerCapabilities:
        return dataclasses.replace(self.server.capabilities, forget_session=False)


def one_side(told: bool, model: str, recipe: Path) -> dict[str, Any]:
    from agentloop_engines.adapters.hf import HFServer
    from agentloop_engines.serving.server import ServerThread
    from agentloop_trainer.config.loading import load_config
    from agentloop_trainer.rollout.engines import rollout_dtype
    from agentloop_trainer.stages.rollout_setup import evaluate_checkpoint

    cfg = load_config([f"model.path={model}"], config_file=recipe)
    r = cfg.actor_rollout_ref.rollout
    engine = HFServer(model, dtype=rollout_dtype(r, cfg.model.dtype, lambda line: None),
                      max_batch_size=r.max_batch_size, seed=0)
    with ServerThread(engine if told else Silent(engine)) as thread:
        cfg = load_config([f"model.path={model}", f"actor_rollout_ref.rollout.server_urls=[{thread.url}]"],
                          config_file=recipe)
        start = time.perf_counter()
        result = evaluate_checkpoint(cfg, model)
        wall = time.perf_counter() - start
    s = engine.stats
    return {"told": told, "wall_s": wall, "accuracy": result.accuracy, "n": result.n, "engine_dtype": str(engine.model.dtype),
            "second_turn_hits": s["prefix_cache_hits"], "misses": s["prefix_cache_misses"],
            "evictions": s["prefix_cache_evictions"], "forgotten": s["prefix_cache_forgotten"],
            "entries_left": len(engine.prefix_cache or ()), "load": load_average()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the recipe's SFT checkpoint (<run>/sft/hf)")
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    keys = ("second_turn_hits", "misses", "evictions", "forgotten", "entries_left", "accuracy", "wall_s")
    runs = alternate(args.rounds, lambda told: one_side(told, args.model, args.recipe), keys)
    text = sides_table(runs, keys, f"The recipe's held-out evaluation over HTTP ({runs[True][0]['n']} problems, "
                                   f"engine {runs[True][0]['engine_dtype']}); medians of {args.rounds}")
    write_result("forget_recipe_eval", {"description": __doc__, "model": args.model, "recipe": str(args.recipe),
                                        "runs": {"told": runs[True], "not_told": runs[False]}, "table_markdown": text,
                                        "versions": versions("torch", "transformers")})


if __name__ == "__main__":
    main()
