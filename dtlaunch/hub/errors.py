"""One-line errors for what the hub or the network answered (exit 2), and the missing-extra message."""

from __future__ import annotations

import errno
import os
from typing import Any

from dtlaunch.errors import DtlaunchError, InputError

INSTALL = "pip install 'dtlaunch[hub]'"


def hub_module() -> Any:
    """huggingface_hub, or the one-line refusal naming the extra that provides it."""
    try:
        # huggingface_hub.file_download loaded explicitly: the package's lazy attributes do not include this
        # submodule, so `huggingface_hub.file_download` fails unless something imported it first (a hub
        # dataset fetched before any hub model did: "No huggingface_hub attribute file_download").
        import huggingface_hub
        import huggingface_hub.file_download  # noqa: F401
    except ImportError:
        raise InputError(f"hub names (ORG/NAME) need the 'huggingface_hub' package: {INSTALL}") from None
    return huggingface_hub


def _endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def _hub_says(exc: BaseException) -> str:
    """The hub's own explanation (its X-Error-Message header, which may name close matches), or ''."""
    response = getattr(exc, "response", None)
    said = response.headers.get("X-Error-Message", "") if response is not None else ""
    return f" (the hub says: {said.strip()})" if said.strip() else ""


def translate(exc: BaseException, key: str, name: str, kind: str = "model") -> DtlaunchError:
    """The DtlaunchError for one hub failure; `key` is the setting (or argument) that named `name`."""
    from huggingface_hub import errors as e

    where = f"{key}={name}"
    # `name` is as the user wrote it: hf:ORG/NAME for a model, ORG/NAME for a dataset.
    download = f"dtlaunch download {name if kind == 'model' else 'dataset:' + name}"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return InputError(
            f"{where}: the disk filled while downloading ({os.strerror(exc.errno)}); the partial files were "
            f"removed: free space under HF_HUB_CACHE (or point HF_HOME elsewhere) and run again"
        )
    if isinstance(exc, e.GatedRepoError):
        token = "the token in HF_TOKEN has no access" if os.environ.get("HF_TOKEN") else "no token was given"
        return InputError(
            f"{where} is a gated {kind} and {token}: accept its terms on the hub, then set HF_TOKEN to a token "
            f"of that account"
        )
    if isinstance(exc, e.RevisionNotFoundError):
        return InputError(
            f"{where}: the hub has no such revision{_hub_says(exc)}: use an existing branch, tag or commit hash"
        )
    if isinstance(exc, e.RepositoryNotFoundError):
        token = "" if os.environ.get("HF_TOKEN") else " (or, if it is private, set HF_TOKEN)"
        local = " (no local directory of that name exists either)" if kind == "model" else ""
        return InputError(f"{where}: no such {kind} on the hub{_hub_says(exc)}{local}: check the name{token}")
    if isinstance(exc, e.RemoteEntryNotFoundError):
        return InputError(f"{where}: the hub has no config.json for it: it is not a model repository")
    if isinstance(exc, e.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            fix = "HF_TOKEN is refused: set HF_TOKEN to a valid token with read access"
            if not os.environ.get("HF_TOKEN"):
                fix = "it needs a token: set HF_TOKEN to a token with read access"
            return InputError(f"{where}: the hub answered {status}{_hub_says(exc)}: {fix}")
        return InputError(f"{where}: the hub answered {status}{_hub_says(exc)}: try again later")
    if isinstance(exc, e.LocalEntryNotFoundError) and isinstance(exc.__cause__, e.HfHubHTTPError):
        # huggingface_hub falls back to the cache on a refusal it does not raise at once (403, 5xx) and,
        # the cache being empty, reports the miss: the refusal is what the user must fix.
        return translate(exc.__cause__, key, name, kind)
    if isinstance(exc, (e.OfflineModeIsEnabled, e.LocalEntryNotFoundError)):
        from huggingface_hub import constants

        if constants.is_offline_mode():
            return InputError(
                f"{where} is not in the cache and HF_HUB_OFFLINE=1: run `{download}` where the hub is reachable "
                f"(same HF_HOME / HF_HUB_CACHE), or unset HF_HUB_OFFLINE"
            )
        return InputError(
            f"{where}: cannot reach the hub at {_endpoint()} and it is not in the cache: check the network "
            f"(HF_ENDPOINT, proxy), or run `{download}` where it is reachable and set HF_HUB_OFFLINE=1"
        )
    if isinstance(exc, e.HFValidationError):
        return InputError(f"{where}: not a valid hub name ({str(exc).splitlines()[0]}): use ORG/NAME[@REVISION]")
    raise exc
