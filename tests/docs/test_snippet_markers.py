"""The snippet markers: parsed as documented, and a typo is an error rather than a silent pass."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import SnippetMarkerError, page_snippets


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def test_markers(tmp_path: Path) -> None:
    page = _page(tmp_path, '''
```bash
echo plain
```

<!-- snippet: skip reason="needs a GPU" -->
```python
import torch
```

<!-- snippet: run-with trainer.total_steps=1 -->
```bash
agentloop train a=1 \\
  b=2   # a comment
agentloop eval ckpt
ls
```

<!-- snippet: file t/x.yaml -->
```yaml
k: v
```

```yaml
not: run
```
''')
    plain, skip, run_with, file = page_snippets(page)
    assert (plain.kind, plain.body, plain.line) == ("run", "echo plain\n", 2)
    assert (skip.kind, skip.arg, skip.lang) == ("skip", "needs a GPU", "python")
    assert run_with.command() == ("agentloop train a=1    b=2 trainer.total_steps=1   # a comment\n"
                                  "agentloop eval ckpt trainer.total_steps=1\nls\n")
    assert (file.kind, file.arg, file.body) == ("file", "t/x.yaml", "k: v\n")


@pytest.mark.parametrize("marker", [
    "<!-- snippet: skpi reason=\"x\" -->",          # a typo in the kind
    "<!-- snippet: skip -->",                       # a skip without its reason
    "<!-- snippet: file ../outside.py -->",        # a file outside the page's folder
    "<!-- snippet: run-with -->",                   # run-with without overrides
])
def test_bad_markers_are_errors(tmp_path: Path, marker: str) -> None:
    with pytest.raises(SnippetMarkerError):
        page_snippets(_page(tmp_path, f"{marker}\n```bash\necho hi\n```\n"))
