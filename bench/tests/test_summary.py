"""``summary.py`` prints every results file's tables, the run_all ones first (its README says
"every table in results/"; it printed a fixed list of ten)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import summary  # noqa: E402


def test_every_results_file_is_printed_the_run_all_ones_first(tmp_path, capsys):
    (tmp_path / "main_job.json").write_text(json.dumps({"date": "2026-12-07T10:00:00", "table_markdown": "| main |"}))
    (tmp_path / "forget_http.json").write_text(json.dumps({"date": "2026-12-07T11:00:00", "table_markdown": "| fh |",
                                                           "load_average_at_start": [0.5, 0.4, 0.3]}))
    (tmp_path / "aaa.json").write_text(json.dumps({"sides": {"x": {"table_markdown": "| nested |"}}}))
    summary.main(tmp_path)
    out = capsys.readouterr().out
    assert out.index("### main_job") < out.index("### overlap") < out.index("### aaa") < out.index("### forget_http")
    assert "(no results yet: run `python bench/run_all.py --only overlap`)" in out
    assert "| fh |" in out
    assert "| nested |" in out
    assert "2026-12-07, load average (1/5/15 min) at start [0.5, 0.4, 0.3]" in out
    assert "### aaa\n\nundated" in out
