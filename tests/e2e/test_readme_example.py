"""The README's "As a library" code block is the marked core of examples/flexdemo_causal_lm.py, verbatim.

A unit test (no process): tests/e2e/test_examples.py runs the example itself under torchrun.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "flexdemo_causal_lm.py"
START, END = "# --- readme-start ---\n", "# --- readme-end ---\n"


def _region(path: Path) -> str:
    text = path.read_text()
    assert text.count(START) == 1 and text.count(END) == 1, f"{path} needs one readme-start and one readme-end marker"
    region = text[text.index(START) + len(START):text.index(END)]
    assert region, f"the marked region of {path} is empty"
    return region


def _library_section() -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index("\n## As a library\n")
    end = readme.index("\n## ", start + 1)
    return readme[start:end]


def test_readme_library_block_is_the_marked_region() -> None:
    blocks = re.findall(r"^```python\n(.*?)^```$", _library_section(), re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, f"expected one python block under 'As a library', found {len(blocks)}"
    assert blocks[0] == _region(EXAMPLE), (
        "README.md's 'As a library' block differs from the region of examples/flexdemo_causal_lm.py between "
        "the readme-start and readme-end markers: copy the region into the README unchanged"
    )


def test_region_clips_before_the_step() -> None:
    """The README says gradients are clipped before step() "(as above)": FlexDeMo overwrites them in step()."""
    lines = [line.strip() for line in _region(EXAMPLE).splitlines()]
    clip = next(i for i, line in enumerate(lines) if line.startswith("torch.nn.utils.clip_grad_norm_("))
    step = lines.index("opt.step()")
    zero = lines.index("opt.zero_grad()")
    backward = lines.index("loss.backward()")
    assert backward < clip < step < zero, lines


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "examples").glob("*.py")))
def test_examples_parse(script: str) -> None:
    ast.parse((REPO / "examples" / script).read_text(), filename=script)
