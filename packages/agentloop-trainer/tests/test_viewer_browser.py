"""The trajectory viewer in real headless Chromium, offline: what the DOM shows against the data.

Needs Debian's ``chromium`` (``apt-get install -y chromium``; nox's trainer session installs it
when it can) and ``playwright`` (the trainer's test extra); Playwright's own browser download is
not used. Each test skips with the reason when either is missing."""

from __future__ import annotations

import shutil

import pytest
from test_viewer import sample_records

sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright: pip install 'agentloop-trainer[test]'")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install -y chromium)")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI containers run as root, where Chromium's sandbox refuses to start.
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, tokenizer, tmp_path):
    from agentloop_trainer.view import write_jsonl, write_view

    records, first = sample_records(tokenizer)
    out = write_view(write_jsonl(records, tmp_path / "r.jsonl"))
    context = browser.new_context(offline=True)
    requests = []
    context.on("request", lambda r: requests.append(r.url))
    pg = context.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(out.resolve().as_uri())
    pg.records, pg.first = records, first
    yield pg
    assert errors == [], f"the page's script raised: {errors}"
    assert [u for u in requests if not u.startswith("file://")] == [], "the page fetched something"
    context.close()


def test_model_coloured_tokens_equal_the_mask_1_count(page):
    """Each trajectory shows one visible model-coloured token per mask-1 token (all segments).
    Debug: _tokens_html's kinds, and show() in the script hiding the other trajectories."""
    from agentloop_trainer.view import group_trajectories

    for index, segments in enumerate(group_trajectories(page.records)):
        page.click(f"#traj-table tr[data-index='{index}']")
        assert page.locator(f"#traj-{index}").is_visible()
        generated = sum(sum(s["response_mask"]) for s in segments)
        assert page.locator(f"#traj-{index} .tok.gen:visible").count() == generated
        assert page.locator("section.detail:visible").count() == 1


def test_hovering_a_token_shows_its_log_prob(page):
    """The tooltip over a generated token shows its id and the engine's log-prob."""
    record = page.records[0]
    k = record["response_mask"].index(1)
    token = page.locator("#traj-0 .tok.gen").first
    token.hover()
    tip = page.locator("#tip")
    assert tip.is_visible()
    assert f"logprob {record['rollout_log_probs'][k]:.4f}" in tip.inner_text()
    assert f"id {record['response_ids'][k]}" in tip.inner_text()


def test_filters_hide_what_they_should(page):
    """failed / reward / tool-call / segment / group filters leave exactly the matching rows."""
    visible = lambda: sorted(int(i) for i in page.locator("#traj-table tr.traj-row:visible").evaluate_all(  # noqa: E731
        "rs => rs.map(r => r.dataset.index)"))
    assert visible() == [0, 1, 2, 3]
    page.select_option("#f-failed", "1")
    assert visible() == [2]
    page.select_option("#f-failed", "")
    page.fill("#f-reward-min", "0.5")
    assert visible() == [0, 3]
    page.fill("#f-reward-min", "")
    page.fill("#f-segments-min", "2")
    assert visible() == [1]
    page.fill("#f-segments-min", "")
    page.fill("#f-group", "train-1-1")
    assert visible() == [2, 3]
    assert page.locator("#count").inner_text() == "2 of 4 shown"


def test_worst_and_best_are_one_click_away(page):
    """'worst first' sorts by reward ascending and opens the first row; 'best first' the reverse."""
    page.click("#best")
    assert page.locator("#traj-table tr.traj-row").first.get_attribute("data-index") == "0"
    assert page.locator("#traj-0").is_visible()
    page.click("#worst")
    assert page.locator("#traj-table tr.traj-row").first.get_attribute("data-reward") == "0.0"


def test_a_mismatch_is_rendered_side_by_side(page):
    """The mismatching trajectory shows expected and actual tokens in two columns from the first
    difference, that row marked. Debug: _mismatch_html."""
    record = page.records[-1]
    page.click("#traj-table tr[data-index='3']")
    table = page.locator("#traj-3 .mismatch")
    assert table.is_visible()
    assert int(table.get_attribute("data-first")) == page.first
    row = table.locator(f"tr.diff[data-i='{page.first}']")
    ids = row.locator("td.id").all_inner_texts()
    actual = (record["prompt_ids"] + record["response_ids"])[page.first]
    assert ids == [str(record["expected_ids"][page.first]), str(actual)]
    assert table.locator("tr.same").first.get_attribute("data-i") == str(page.first - 2)
    assert "sanity check mismatch" in page.locator("#traj-3 .verdict").inner_text()
