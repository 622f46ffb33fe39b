"""A ``--model`` that is a Hugging Face hub id: its checkpoint folder, through huggingface_hub.

An existing folder is used as it is. Anything else shaped like a hub id (``name`` or
``org/name``) is fetched with ``huggingface_hub.snapshot_download``: from the hub when online
(config, weights, tokenizer and template files only), from its cache when ``HF_HUB_OFFLINE`` is
set or the cache already holds it; ``HF_HUB_CACHE`` / ``HF_HOME`` choose the cache as usual.
Invariants: a model that is neither a folder nor obtainable is a ``CheckpointError`` naming it
and saying why; nothing is downloaded for a folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from epserve.models.config import CheckpointError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
#: What serving a checkpoint reads (no other weight formats, no images or docs).
FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def is_hub_id(model: str) -> bool:
    return not Path(model).exists() and HUB_ID.fullmatch(model) is not None \
        and ".." not in model


def local_checkpoint(model: str) -> str:
    """``model``'s checkpoint folder: itself when it is a path, else the hub snapshot."""
    if not is_hub_id(model):
        return model
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        return snapshot_download(model, cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                                 local_files_only=offline, allow_patterns=FILES)
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set and the Hugging Face cache does not hold it" if offline \
            else "the Hugging Face cache does not hold it and the hub cannot be reached"
        raise CheckpointError(f"model {model}: no such folder, and {why}") from None
    except Exception as exc:  # the hub's answers: no such repo, gated, revision, network
        raise CheckpointError(f"model {model}: no such folder, and the Hugging Face hub did "
                              f"not provide it ({type(exc).__name__}: {exc})") from None
