"""Hub ids ("org/name", "org/name@revision") through `huggingface_hub`: the local cache first,
then a download unless offline.

The cache is huggingface_hub's own (`HF_HUB_CACHE`, default `$HF_HOME/hub`) and so are its
rules: `refs/<branch>` names the commit of a branch or tag, a full commit hash names itself.
A repository missing from the cache is downloaded (config, tokenizer and safetensors files;
`snapshot_download`) unless `HF_HUB_OFFLINE=1`, in which case the error says so. GGUF-only
repositories are found in the cache (the snapshot's sole .gguf file is loaded) but not
downloaded: they hold one file per quantization, so fetch the one you want with
`hf download org/name FILE.gguf`.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmopt.errors import LlmoptError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what loading a transformers model needs (weights, config, tokenizer, chat template)
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt")


class HubCacheError(LlmoptError, FileNotFoundError):
    """A Hub id that is neither in the local cache nor downloadable now."""


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloaded repositories (its variables, its defaults)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def looks_like_hub_id(spec: str) -> bool:
    """org/name[@rev]; a missing relative file path such as `runs/model.gguf` is not one."""
    repo = spec.split("@", 1)[0]
    if repo.endswith((".gguf", ".safetensors", ".json")):
        return False
    return bool(_REPO_ID.match(repo)) and ".." not in repo


def cached_snapshot(spec: str) -> Path:
    """The snapshot directory of `org/name[@revision]` (revision: branch, tag or commit),
    downloaded first when it is not cached and the Hub may be reached."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, _, revision = spec.partition("@")
    revision = revision or None
    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    cache = hub_cache_dir()
    if constants.is_offline_mode():
        raise HubCacheError(
            f"{spec!r} is not a local path and not in the HF cache {cache}, and HF_HUB_OFFLINE "
            f"is set; fetch it while online (e.g. `hf download {repo}`) or unset HF_HUB_OFFLINE"
        )
    try:
        path = snapshot_download(repo, revision=revision, allow_patterns=list(DOWNLOAD_PATTERNS))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HubCacheError(
            f"{spec!r} is not a local path, not in the HF cache {cache}, and could not be "
            f"downloaded from the Hugging Face Hub: {reason}"
        ) from None
    return Path(path)
