"""docs/configs/ holds what `llmopt plan --emit` writes today for the default scenario."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmopt.cli import main

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configs"
# file -> (--pick, side files): the commands docs/configs/README.md lists
EMITTED = {
    "llama-3-70b.run.toml": (1, []),
    "llama-3-70b.megatron.sh": (1, []),
    "llama-3-70b.nemo.sh": (1, []),
    "llama-3-70b.torchtitan.toml": (6, []),
    "llama-3-70b.deepspeed.json": (464, ["llama-3-70b.deepspeed.launch.sh"]),
}


def test_docs_list_every_emitted_file():
    readme = (DOCS / "README.md").read_text()
    for name, (pick, _) in EMITTED.items():
        command = f"llmopt plan --emit docs/configs/{name}" + (
            f" --pick {pick}" if pick > 1 else ""
        )
        assert f"`{command}`" in readme, command
    listed = {p.name for p in DOCS.iterdir()} - {"README.md"}
    assert listed == set(EMITTED) | {s for _, sides in EMITTED.values() for s in sides}


@pytest.mark.parametrize("name", sorted(EMITTED))
def test_docs_configs_are_what_emit_writes(name, tmp_path, capsys):
    pick, sides = EMITTED[name]
    assert main(["plan", "--top-k", "1", "--emit", str(tmp_path / name), "--pick", str(pick)]) == 0
    capsys.readouterr()
    for file in [name, *sides]:
        assert (tmp_path / file).read_text() == (DOCS / file).read_text(), file
