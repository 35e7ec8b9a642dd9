"""Hub ids ("org/name", "org/name@revision") resolved from the local Hugging Face cache.

llmopt never downloads; a model fetched earlier by transformers or `hf download` sits in
`$HF_HUB_CACHE` (default `$HF_HOME/hub`, i.e. `~/.cache/huggingface/hub`) as
`models--org--name/snapshots/<commit>/`, with `refs/<branch>` holding the commit of a branch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from llmopt.errors import LlmoptError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class HubCacheError(LlmoptError, FileNotFoundError):
    """A Hub id that is not (or not unambiguously) in the local cache."""


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloaded repositories (same variables, same defaults)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def looks_like_hub_id(spec: str) -> bool:
    """org/name[@rev]; a missing relative file path such as `runs/model.gguf` is not one."""
    repo = spec.split("@", 1)[0]
    if repo.endswith((".gguf", ".safetensors", ".json")):
        return False
    return bool(_REPO_ID.match(repo)) and ".." not in repo


def cached_snapshot(spec: str) -> Path:
    """The snapshot directory of `org/name[@revision]` (revision: branch, tag or commit)."""
    repo, _, revision = spec.partition("@")
    revision = revision or "main"
    cache = hub_cache_dir()
    root = cache / f"models--{repo.replace('/', '--')}"
    hint = f"llmopt does not download; fetch it first (e.g. `hf download {repo}`)"
    if not root.is_dir():
        raise HubCacheError(f"{spec!r} is not a local path and not in the HF cache {cache}; {hint}")
    snapshots = root / "snapshots"
    ref = root / "refs" / revision
    if _COMMIT.match(revision):
        commit = revision
    elif ref.is_file():
        commit = ref.read_text().strip()
    else:
        present = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
        if revision != "main" or len(present) != 1:
            raise HubCacheError(
                f"{spec!r}: the HF cache {root} has no ref {revision!r} (snapshots: "
                f"{', '.join(present) or 'none'}); pass org/name@<commit>"
            )
        commit = present[0]
    snapshot = snapshots / commit
    if not snapshot.is_dir():
        raise HubCacheError(
            f"{spec!r}: revision {revision} -> {commit}, not in {snapshots}; {hint}"
        )
    return snapshot
