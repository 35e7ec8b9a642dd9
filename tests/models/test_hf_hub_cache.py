"""Hub ids resolve through huggingface_hub from a cache the test lays out as huggingface_hub
writes it; offline mode is on, so nothing here can reach the network."""

from __future__ import annotations

import shutil

import pytest
import torch

from llmopt.models.hub_cache import HubCacheError, hub_cache_dir
from llmopt.models.loading import load_model, resolve_spec, save_pretrained
from llmopt.models.registry import resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(autouse=True)
def hub(tmp_path, monkeypatch):
    """An empty cache and offline mode, set where huggingface_hub reads them (its constants
    are read from the environment once, at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


@pytest.fixture
def cache(hub, tiny_model):
    root = hub / "models--acme--tiny-llama"
    save_pretrained(tiny_model, root / "snapshots" / COMMIT)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
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
    with pytest.raises(
        HubCacheError,
        match="'acme/tiny-llama@v3' is not a local path and not in the HF cache .*HF_HUB_OFFLINE is set",
    ):
        resolve_spec("acme/tiny-llama@v3")


def test_gguf_only_snapshot(hub):
    root = hub / "models--acme--smol-gguf"
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / "smol.Q4_1.gguf").symlink_to(resolve("smollm2-135m"))  # blobs are symlinked too
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    assert resolve_spec("acme/smol-gguf") == ("gguf", snap / "smol.Q4_1.gguf")


def test_missing_repo_offline_names_the_cache_and_offline_mode(hub):
    with pytest.raises(
        HubCacheError,
        match=r"'acme/absent' is not a local path and not in the HF cache .*hub, and HF_HUB_OFFLINE "
        r"is set; fetch it while online \(e.g. `hf download acme/absent`\)",
    ):
        load_model("acme/absent")
    with pytest.raises(FileNotFoundError, match="model file or directory not found: runs/m.gguf"):
        load_model("runs/m.gguf")  # a missing relative path, not a Hub id


def test_online_miss_downloads_through_huggingface_hub(hub, monkeypatch, tiny_model):
    """Not cached and online: huggingface_hub's snapshot_download fetches the weights, config
    and tokenizer files (stood in for here: the test never reaches the network)."""
    import huggingface_hub
    from huggingface_hub import constants

    calls = []

    def fake_download(repo_id, revision=None, local_files_only=False, allow_patterns=None):
        calls.append((repo_id, revision, local_files_only, allow_patterns))
        if local_files_only:
            return real(repo_id, revision=revision, local_files_only=True)
        snap = hub / "fetched"
        save_pretrained(tiny_model, snap)
        return str(snap)

    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_spec("acme/remote@v1") == ("hf", hub / "fetched")
    assert calls[0][:3] == ("acme/remote", "v1", True)  # the cache is asked first
    assert calls[1][:3] == ("acme/remote", "v1", False)
    assert "*.safetensors" in calls[1][3] and "*.json" in calls[1][3]


def test_cache_location_is_huggingface_hubs(hub):
    assert hub_cache_dir() == hub
