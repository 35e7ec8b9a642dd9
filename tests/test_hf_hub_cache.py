"""Hub ids resolve offline from a HF cache laid out as huggingface_hub writes it."""

from __future__ import annotations

import shutil

import pytest
import torch

from llmopt.models.hub_cache import HubCacheError, hub_cache_dir
from llmopt.models.loading import load_model, resolve_spec, save_pretrained
from llmopt.models.registry import resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def cache(tmp_path, monkeypatch, tiny_model):
    root = tmp_path / "hub" / "models--acme--tiny-llama"
    save_pretrained(tiny_model, root / "snapshots" / COMMIT)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT + "\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return root


def test_hub_id_loads_the_snapshot_of_main(cache, tiny_model):
    assert resolve_spec("acme/tiny-llama") == ("hf", cache / "snapshots" / COMMIT)
    tokens = torch.arange(12).view(1, 12)
    with torch.no_grad():
        assert torch.equal(load_model("acme/tiny-llama")(tokens), tiny_model(tokens))


def test_revisions_by_commit_and_by_ref(cache):
    shutil.copytree(cache / "snapshots" / COMMIT, cache / "snapshots" / OTHER)
    (cache / "refs" / "v2").write_text(OTHER)
    assert resolve_spec(f"acme/tiny-llama@{OTHER}")[1] == cache / "snapshots" / OTHER
    assert resolve_spec("acme/tiny-llama@v2")[1] == cache / "snapshots" / OTHER
    with pytest.raises(HubCacheError, match="has no ref 'v3'"):
        resolve_spec("acme/tiny-llama@v3")


def test_gguf_only_snapshot(tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "models--acme--smol-gguf" / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / "smol.Q4_1.gguf").symlink_to(resolve("smollm2-135m"))  # blobs are symlinked too
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_spec("acme/smol-gguf") == ("gguf", snap / "smol.Q4_1.gguf")  # sole snapshot


def test_missing_repo_names_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(
        HubCacheError, match="not in the HF cache .*empty; llmopt does not download"
    ):
        load_model("acme/absent")
    with pytest.raises(FileNotFoundError, match="model file or directory not found: runs/m.gguf"):
        load_model("runs/m.gguf")  # a missing relative path, not a Hub id


def test_cache_location_follows_hf_home(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
