"""Local directory or Hugging Face repository -> local directory, with errors a person can act on."""

from pathlib import Path

WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class HubError(RuntimeError):
    """A checkpoint could not be found locally or fetched from the hub."""


def is_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def unreachable_message(repo_id: str, what: str, reason: str) -> str:
    return (
        f"cannot get the {what} {repo_id!r} from the Hugging Face hub ({reason}).\n"
        f"  - online: check the name; for gated models accept the licence on the model page and\n"
        f"    log in with `hf auth login` or set HF_TOKEN=<your token>\n"
        f"  - offline: download it elsewhere (`hf download {repo_id}`) and copy the\n"
        f"    cache, or pass a local directory instead of a repository id"
    )


def fetch(name: str, what: str = "model") -> Path:
    """A local directory for ``name``: itself if it exists, else a hub snapshot.

    Downloads show huggingface-hub's progress bars and land in the standard
    cache; with ``HF_HUB_OFFLINE=1`` only the cache is consulted.
    """
    path = Path(name).expanduser()
    if path.exists():
        return path
    if not is_repo_id(name):
        raise HubError(f"{what} {name!r} is neither an existing local path nor a hub repository id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(name, allow_patterns=WEIGHT_PATTERNS))
    except GatedRepoError as error:
        raise HubError(unreachable_message(name, what, "gated repository: log in first")) from error
    except RepositoryNotFoundError as error:
        raise HubError(unreachable_message(name, what, "no such repository, or it is private")) from error
    except LocalEntryNotFoundError as error:
        raise HubError(unreachable_message(name, what, "offline and not in the local cache")) from error
    except (HfHubHTTPError, OSError) as error:
        raise HubError(unreachable_message(name, what, f"network error: {error.__class__.__name__}")) from error
