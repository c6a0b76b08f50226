"""Write the calculator task as parquet rows that the LangGraph ReAct agent (``react_agent``) rolls out.

The rows are the trainer's synthetic calculator problems (same questions, system prompt and
calculator ``tools_kwargs``); only ``agent_name`` changes, which is how a dataset picks its loop.

    python examples/langgraph_calculator/make_data.py --out data/langgraph_calculator
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/langgraph_calculator", help="output folder")
    parser.add_argument("--train-size", type=int, default=20000)
    parser.add_argument("--val-size", type=int, default=200)
    parser.add_argument("--agent-name", default="react_agent", help="agent loop registered name")
    args = parser.parse_args()

    from agentloop_trainer.data import write_parquet_rows
    from agentloop_trainer.task import dataset_row, make_problems

    train = make_problems(args.train_size, seed=1)
    seen = {p.question for p in train}
    # Held-out questions never occur in training, so accuracy measures generalisation.
    val = [p for p in make_problems(args.val_size * 3, seed=2) if p.question not in seen][: args.val_size]
    out = Path(args.out)
    for split, problems in (("train", train), ("test", val)):
        rows = [{**dataset_row(p, split), "agent_name": args.agent_name} for p in problems]
        path = write_parquet_rows(rows, out / f"{split}.parquet")
        print(f"{split}: {len(rows)} rows -> {path}")


if __name__ == "__main__":
    main()
