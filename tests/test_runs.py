"""The shipped run files: each one parses, and the parameter counts its comments document are the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainer.config import RunConfig
from trainer.model import stage_parameter_counts

RUNS = sorted((Path(__file__).resolve().parent.parent / "trainer" / "runs").glob("*.toml"))


def documented_counts(text: str) -> tuple[list[int], int | None]:
    stages = [(int(s), int(n.replace(",", ""))) for s, n in re.findall(r"^#\s+stage (\d+):\s+([\d,]+)", text, re.M)]
    total = re.search(r"^#\s+total:\s+([\d,]+)", text, re.M)
    assert [s for s, _ in stages] == list(range(len(stages)))
    return [n for _, n in stages], int(total.group(1).replace(",", "")) if total else None


@pytest.mark.parametrize("path", RUNS, ids=[p.stem for p in RUNS])
def test_documented_parameter_counts_are_the_code_s(path):
    run = RunConfig.from_toml(path)
    counts, total = documented_counts(path.read_text())
    if path.stem.startswith("llama"):
        assert counts, f"{path.name} documents no parameter counts"
    if counts:
        assert counts == stage_parameter_counts(run), path.name
        assert total == sum(counts)


def test_the_llama_runs_have_the_sizes_their_names_say():
    sizes = {p.stem: sum(stage_parameter_counts(RunConfig.from_toml(p))) for p in RUNS if p.stem.startswith("llama")}
    assert 20e6 <= sizes["llama-small"] <= 40e6
    assert 110e6 <= sizes["llama-125m"] <= 140e6
    assert 0.9e9 <= sizes["llama-1b"] <= 1.3e9


@pytest.mark.parametrize("path", [p for p in RUNS if p.stem.startswith("llama")], ids=lambda p: p.stem)
def test_transformers_builds_the_same_model_for_every_llama_run(path):
    """The Hugging Face class of each shipped run has our parameters, name for name and shape for shape."""
    import torch

    transformers = pytest.importorskip("transformers")
    from trainer.hf import hf_config
    from trainer.model import build_model

    run = RunConfig.from_toml(path)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(hf_config(run)).state_dict()
        ours = build_model(run.model).state_dict()
    assert {k: v.shape for k, v in theirs.items()} == {k: v.shape for k, v in ours.items()}
