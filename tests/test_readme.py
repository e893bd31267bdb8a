"""README.md's Python blocks run as written, each in a fresh interpreter (as a reader would paste
it), against a real sidecar named ``default`` on a 384-dim store (the dimension of the default
text embedder, which the text block uses). The sidecar lives in this test's own runtime
directory; a sidecar name is also locked per user, so if another ``default`` sidecar of this
user runs (someone's ``kalos demo``), the test skips, saying so.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from conftest import DEADLINE_S

from kalos.client.embed import DEFAULT_DIM, embed_extra_available
from kalos.errors import SidecarUnavailable

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)


def test_the_readme_has_its_python_blocks():
    assert len(BLOCKS) >= 2, BLOCKS  # the API block and the text block
    assert any("recall_many" in b for b in BLOCKS) and any("recall_text" in b for b in BLOCKS)


@pytest.fixture(scope="module")
def default_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A sidecar named "default"; yields the environment a reader's process would have."""
    from conftest import SidecarPool, short_tempdir

    runtime = short_tempdir("kr")
    env = {**os.environ, "KALOS_RUNTIME_DIR": runtime, "HF_HUB_OFFLINE": "1"}
    saved = os.environ.get("KALOS_RUNTIME_DIR")
    os.environ["KALOS_RUNTIME_DIR"] = runtime  # SidecarProcess passes this process's environment on
    pool = SidecarPool()
    try:
        try:
            pool.start(tmp_path_factory.mktemp("readme") / "memories.db", name="default", dim=DEFAULT_DIM)
        except SidecarUnavailable as exc:
            if "already" in str(exc):
                pytest.skip(f"another sidecar named 'default' runs for this user: {str(exc)[-300:]}")
            raise
        yield env
    finally:
        pool.cleanup()
        if saved is None:
            os.environ.pop("KALOS_RUNTIME_DIR", None)
        else:
            os.environ["KALOS_RUNTIME_DIR"] = saved


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_python_block_runs_as_written(default_sidecar, index):
    block = BLOCKS[index]
    if "recall_text" in block or "remember(" in block:
        if not embed_extra_available():
            pytest.skip("this block needs the embed extra (sentence-transformers and the packaged model)")
    out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, env=default_sidecar,
                         timeout=DEADLINE_S * 3)
    assert out.returncode == 0, f"README block {index} failed:\n{block}\n--- stderr:\n{out.stderr}"
    if "recall_many" in block:
        assert "'count': 90" in out.stdout, out.stdout  # 100 added, 10 deleted
    if "recall_text" in block:
        assert "The user prefers window seats." in out.stdout, out.stdout
