"""Whether the Hugging Face hub can give what a run needs, asked before anything starts: in at most
:data:`HUB_TIMEOUT_S`, instead of the half minute of retries loading it would take, and never when the hub is off.

    problem = hub_problem("openai/gsm8k", "dataset", "task gsm8k's data", fix)   # None: the hub has it (or answered)

The caller first looks in its local cache (a model's config.json, a dataset's prepared copy); this is asked only when
that missed. huggingface_hub is imported here, when asked, so that parsing a command line never loads it.
"""

from __future__ import annotations

HUB_TIMEOUT_S = 5  # how long a check waits for the hub


def hub_problem(repo_id: str, repo_type: str, what: str, fix: str) -> str | None:
    """Why ``repo_id`` (``repo_type``: "model" or "dataset"), not in the local cache, cannot be loaded: the hub is
    offline (``HF_HUB_OFFLINE``) or unreachable, or has no such repository; one line starting with ``what`` and ending
    with ``fix``. None when the hub has it, or answered (loading will say more, e.g. what access a gated one needs)."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return f"{what} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: {fix}"
    info = huggingface_hub.model_info if repo_type == "model" else huggingface_hub.dataset_info
    try:
        info(repo_id, timeout=HUB_TIMEOUT_S)  # looked up now: tests replace it
    except GatedRepoError:
        return None  # it exists; loading says what access it needs
    except RepositoryNotFoundError:
        return f"{what}: no such {repo_type} on the Hugging Face hub (or a private one: `hf auth login`); {fix}"
    except HfHubHTTPError:
        return None  # the hub answered: loading will say more
    except Exception as e:  # noqa: BLE001 - no network (httpx's ConnectError, a timeout, ...)
        return (f"{what} is not in the local Hugging Face cache and the hub cannot be reached ({type(e).__name__}); "
                f"{fix}")
    return None
