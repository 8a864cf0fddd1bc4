"""Models and datasets from the Hugging Face Hub, downloaded on first use.

`ORG/NAME[@REVISION]` (a model, a tokenizer, a teacher) and `ORG/NAME[/CONFIG][@REVISION]` (a
dataset) name a Hub repository. `download` fetches only the files compiletune reads into the
standard HF cache (`HF_HOME`, `HF_HUB_CACHE`) through huggingface_hub: one line saying what it
asks and what it fetches (files, total size), one progress bar over the bytes (none for a small
total; huggingface_hub's own per-file bars are silenced); files fetched before an interruption
are not fetched again. Every request has a timeout (`HF_HUB_ETAG_TIMEOUT` for metadata,
`HF_HUB_DOWNLOAD_TIMEOUT` for a file's transfer, 10 s by default, read at each call): a Hub
that accepts connections and never answers ends in one line, never in a hang. Later runs find the files there. The environment is read at each call, not when this module is imported:
`HF_ENDPOINT` (a mirror), `HF_HUB_OFFLINE=1` (the cache alone), `HF_TOKEN` or `hf auth login`.

Each failure is one UserError line that says what to do (`explain`). `pin` turns a spec into
`ORG/NAME@<commit>`: train writes that into config.yaml, so `--resume` reads the same files.
Under torchrun every process resolves the same specs: huggingface_hub locks each file in the
cache, so the first process downloads it and the others wait and then find it there.

This is the only module that calls huggingface_hub; docs/hub.md is the user's page.
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from compiletune.errors import UserError
from compiletune.progress import Progress

# A repository id as the Hub spells it, then an optional dataset config, then a revision.
_SPEC = re.compile(
    r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
    r"(?:/(?P<config>[A-Za-z0-9][\w.-]*))?"
    r"(?:@(?P<revision>[\w.-]+(?:/[\w.-]+)*))?"
)
_COMMIT = re.compile(r"[0-9a-f]{40}")

# What a model folder needs beside its weights: configs, tokenizer files and chat templates, at
# the top of the repository (the weights: `model_folder`). Never .bin/.pth/.gguf, nor original/.
TOKENIZER_FILES = ("*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja")
_SUBFOLDERS = ("*/*",)


@dataclass(frozen=True)
class HubRef:
    """A parsed spec: `repo` ("org/name"), `revision` (None: the default branch), and for a
    dataset the `config` (a subset's name, or None)."""

    repo: str
    revision: str | None = None
    config: str | None = None

    def pinned(self, commit: str) -> str:
        """The spec at one commit: what config.yaml keeps."""
        config = f"/{self.config}" if self.config else ""
        return f"{self.repo}{config}@{commit}"

    def __str__(self) -> str:
        config = f"/{self.config}" if self.config else ""
        return f"{self.repo}{config}" + (f"@{self.revision}" if self.revision else "")


def parse(text: str, dataset: bool = False) -> HubRef | None:
    """The HubRef `text` spells, or None when it is not a hub spec (a local path that exists is
    never one; the caller checks that first). A config part is allowed for datasets only."""
    match = _SPEC.fullmatch(text)
    if match is None or ".." in text or (match["config"] and not dataset):
        return None
    return HubRef(match["repo"], match["revision"], match["config"])


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set to a true value, read now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in ("1", "on", "yes", "true")


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def cache_dir() -> Path:
    """The HF hub cache as the environment gives it now (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants  # deferred: the hub library's import cost

    return Path(constants.HF_HUB_CACHE)


DEFAULT_TIMEOUT = 10.0  # seconds: huggingface_hub's own default for metadata and transfers
_BAR_BYTES = 16 << 20  # a download smaller than this finishes before a bar says anything


def _timeout(name: str) -> float:
    """Seconds from the environment variable `name` now, else DEFAULT_TIMEOUT."""
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return DEFAULT_TIMEOUT
    return value if 0 < value < float("inf") else DEFAULT_TIMEOUT


def _fill_timeouts(request) -> None:
    """A request hook of huggingface_hub's HTTP client: a request sent without a timeout (its
    listings pass None, its client has none) gets the metadata one; a timeout a call set (a
    file's transfer, an etag check) is kept."""
    seconds = _timeout("HF_HUB_ETAG_TIMEOUT")
    limits = request.extensions.get("timeout") or {}
    request.extensions["timeout"] = {
        k: seconds if limits.get(k) is None else limits[k]
        for k in ("connect", "read", "write", "pool")
    }


def _with_timeouts(hub) -> float:
    """Give every request huggingface_hub makes a timeout, from the environment now; returns
    the metadata one. Without it an API call (the repository's info, a file listing) to a
    server that accepts the connection and never answers waits forever. A file's transfer
    reads HF_HUB_DOWNLOAD_TIMEOUT from its constants at each request, which the library
    otherwise fixes when it is imported."""
    hub.constants.HF_HUB_DOWNLOAD_TIMEOUT = _timeout("HF_HUB_DOWNLOAD_TIMEOUT")
    session = hub.get_session()
    hooks = getattr(session, "event_hooks", None)
    if hooks is None:  # huggingface_hub < 1.0 (requests): its calls pass the timeouts themselves
        return _timeout("HF_HUB_ETAG_TIMEOUT")
    if _fill_timeouts not in hooks.get("request", []):
        session.event_hooks = {**hooks, "request": [*hooks.get("request", []), _fill_timeouts]}
    return _timeout("HF_HUB_ETAG_TIMEOUT")


def _size_text(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


class _Bar:
    """What huggingface_hub sees as one of its progress bars: silent, and, for the bar of the
    bytes written (`progress` given), feeding ours."""

    def __init__(self, progress: Progress | None, total: object = None) -> None:
        self.progress, self.total, self.n = progress, total, 0

    def update(self, n: float | None = 1) -> None:
        self.n += n or 0
        if self.progress is not None:
            self.progress.update(int(n or 0))

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __getattr__(self, name: str):  # refresh, close, set_description, set_postfix_str, ...
        return lambda *args, **kwargs: None


class _Bars:
    """`tqdm_class` for snapshot_download: it asks for a bar of the files, one of the bytes
    transferred and one of the bytes written (its `desc` "Reconstructing ..."); all are silent
    but the last, which feeds `progress` (None: no bar)."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress

    def __call__(self, *args: object, **kwargs: object) -> _Bar:
        written = str(kwargs.get("desc", "")).startswith("Reconstructing")
        return _Bar(self.progress if written else None, kwargs.get("total"))


def _snapshot(cache: Path, kind: str, repo: str, commit: str) -> Path:
    """Where the HF cache keeps a commit's files."""
    return cache / f"{kind}s--{repo.replace('/', '--')}" / "snapshots" / commit


def _plan(hub, ref: HubRef, kind: str, allow: list[str], ignore: list[str] | None, timeout: float):
    """(commit, [(file, size or None)] not yet in the cache) from one request: the repository's
    info with each file's size."""
    api = hub.HfApi(endpoint=endpoint())
    info = api.repo_info(
        ref.repo, repo_type=kind, revision=ref.revision, files_metadata=True, timeout=timeout
    )
    chosen = hub.utils.filter_repo_objects(
        info.siblings or [], allow_patterns=allow, ignore_patterns=ignore, key=lambda s: s.rfilename
    )
    have = _snapshot(cache_dir(), kind, ref.repo, info.sha)
    return info.sha, [(s.rfilename, s.size) for s in chosen if not (have / s.rfilename).is_file()]


def _hub():
    try:
        import huggingface_hub
        import huggingface_hub.constants  # (submodules this module reads as attributes)
        import huggingface_hub.errors
        import huggingface_hub.utils
    except ImportError as e:  # transformers depends on it; only a broken install lacks it
        raise UserError(
            f"Hub downloads need huggingface_hub ({e}); pip install huggingface_hub"
        ) from e
    return huggingface_hub


def download(
    ref: HubRef,
    kind: str,
    patterns: tuple[str, ...] | list[str],
    flag: str = "--model-dir",
    quiet: bool = False,
) -> Path:
    """The snapshot folder of `ref` in the HF cache, holding the files that match `patterns`
    (top-level only for models), downloaded now if they are not there. `kind` is "model" or
    "dataset"; `flag` names the option in messages; `quiet` skips the line that says the Hub
    is asked. A line names what is fetched (files and total size) and one bar counts its bytes."""
    hub = _hub()
    kwargs = dict(
        repo_type=kind,
        revision=ref.revision,
        cache_dir=str(cache_dir()),
        endpoint=endpoint(),
        allow_patterns=list(patterns),
        ignore_patterns=list(_SUBFOLDERS) if kind == "model" else None,
    )
    pinned = bool(ref.revision and _COMMIT.fullmatch(ref.revision))
    try:
        if offline():
            return Path(hub.snapshot_download(ref.repo, local_files_only=True, **kwargs))
        timeout = _with_timeouts(hub)
        if pinned:  # a commit whose files are all cached needs no request
            try:
                return Path(hub.snapshot_download(ref.repo, local_files_only=True, **kwargs))
            except Exception:  # some are not: asked for below
                pass
        if not quiet:  # said before the first request: it may wait up to `timeout`
            print(
                f"{flag} {ref}: asking {endpoint()} for its files (timeout {timeout:g}s, "
                f"HF_HUB_ETAG_TIMEOUT; cache {cache_dir()})",
                file=sys.stderr,
                flush=True,
            )
        allow, ignore = kwargs["allow_patterns"], kwargs["ignore_patterns"]
        try:
            commit, missing = _plan(hub, ref, kind, allow, ignore, timeout)
        except Exception as e:  # no answer: the cache's copy, as huggingface_hub would fall back
            try:
                return Path(hub.snapshot_download(ref.repo, local_files_only=True, **kwargs))
            except Exception:
                raise e from None
        sizes = [size for _, size in missing]
        total = sum(sizes) if None not in sizes else None
        if missing:
            size = f", {_size_text(total)}" if total is not None else ""
            many = "s" if len(missing) > 1 else ""
            at = "" if ref.revision == commit else f" (commit {commit[:12]})"
            print(
                f"{flag} {ref}: fetching {len(missing)} file{many}{size}{at} into {cache_dir()}",
                file=sys.stderr,
                flush=True,
            )
        progress = None
        if total is not None and total >= _BAR_BYTES:
            progress = Progress(f"{flag} {ref}", total, "B", unit_scale=True)
        try:
            return Path(hub.snapshot_download(ref.repo, tqdm_class=_Bars(progress), **kwargs))
        finally:
            if progress is not None:
                progress.close()
    except Exception as e:
        raise explain(e, ref, kind, flag) from e


def explain(error: BaseException, ref: HubRef, kind: str, flag: str) -> BaseException:
    """One line for a failed download, naming what to do; other errors are returned as they
    are (KeyboardInterrupt, bugs)."""
    if isinstance(error, UserError):
        return error
    hub = _hub()
    errors = hub.errors
    what = f"{flag} {ref}"
    site = endpoint()
    login = "log in with `hf auth login` or set HF_TOKEN"
    if isinstance(error, errors.GatedRepoError):
        return UserError(
            f"{what}: the {kind} is gated; accept its terms on {site}/{_page(ref, kind)} with "
            f"your account, then {login}"
        )
    if isinstance(error, errors.RepositoryNotFoundError):
        status = getattr(getattr(error, "response", None), "status_code", None)
        private = " (the Hub refused the token)" if status == 401 and _token() else ""
        return UserError(
            f"{what}: no such local path, and no {kind} repository {ref.repo} on {site} (or it "
            f"is private{private}); check the name, and for a private one {login}"
        )
    if isinstance(error, errors.RevisionNotFoundError):
        return UserError(
            f"{what}: {ref.repo} has no revision {ref.revision!r}; pass a branch, tag or commit "
            f"that exists (ORG/NAME@REVISION), or drop @{ref.revision}"
        )
    if isinstance(error, errors.LocalEntryNotFoundError) and offline():
        return UserError(
            f"{what}: no such local path, and not in the HF cache ({cache_dir()}) with "
            "HF_HUB_OFFLINE set; run once with network (or unset HF_HUB_OFFLINE), or point "
            "HF_HOME at a cache that holds it"
        )
    if _timed_out(error):
        return UserError(
            f"{what}: {site} did not answer within {_timeout('HF_HUB_ETAG_TIMEOUT'):g}s; with "
            "the files in the HF cache set HF_HUB_OFFLINE=1 to use them, or pass a local folder "
            "(or set HF_ENDPOINT to a mirror, or raise HF_HUB_ETAG_TIMEOUT and "
            "HF_HUB_DOWNLOAD_TIMEOUT for a slow network)"
        )
    if isinstance(error, (errors.LocalEntryNotFoundError, ConnectionError)) or _network(error):
        return UserError(
            f"{what}: no such local path, and {site} cannot be reached with the {kind} not in "
            f"the HF cache ({cache_dir()}); check the network, or set HF_ENDPOINT to a mirror"
        )
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return UserError(
            f"{what}: the disk filled while downloading into {cache_dir()}; free space or set "
            "HF_HOME to a larger disk, and run again (the download resumes)"
        )
    text = " ".join(str(error).split())[:200]
    if isinstance(error, (errors.HfHubHTTPError, OSError)):
        return UserError(
            f"{what}: the download failed ({type(error).__name__}: {text}); run again to "
            "resume it, or set HF_ENDPOINT to a mirror"
        )
    if isinstance(error, ValueError):  # huggingface_hub's HFValidationError: not a repo id
        return UserError(f"{what}: no such local path, and not a Hub id ORG/NAME ({text})")
    return error


def _network(error: BaseException) -> bool:
    """A transport failure of the HTTP client huggingface_hub uses (httpx in 1.x, requests
    before): no connection, a timeout, a broken stream."""
    modules = {c.__module__.split(".")[0] for c in type(error).__mro__}
    return bool(
        modules & {"httpx", "httpx2", "httpcore", "requests", "urllib3"}
    ) and not isinstance(error, _hub().errors.HfHubHTTPError)


def _timed_out(error: BaseException | None) -> bool:
    """A request's timeout, in `error` or what caused it (huggingface_hub falls back to the
    cache on a timeout and raises its own error from it)."""
    seen = 0
    while error is not None and seen < 8:  # (a chain, never a loop)
        if isinstance(error, TimeoutError) or "Timeout" in type(error).__name__:
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _page(ref: HubRef, kind: str) -> str:
    return f"datasets/{ref.repo}" if kind == "dataset" else ref.repo


def _token() -> bool:
    if os.environ.get("HF_TOKEN"):
        return True
    try:
        return _hub().get_token() is not None
    except Exception:  # no token file, unreadable: no token
        return False


def no_model_folder(name: object, flag: str) -> str:
    """The refusal of a model folder that is neither a local path nor a Hub id."""
    return (
        f"model folder {name} does not exist; pass {flag} with a local HF model folder "
        "(config.json, model.safetensors, tokenizer files) or a Hub id ORG/NAME[@REVISION]"
    )


def model_folder(text: str, flag: str = "--model-dir", weights: bool = True) -> Path | None:
    """The local folder of a hub model spec (downloaded if needed), or None when `text` is not
    one. The configs and tokenizer come first; then the weights that
    `model.safetensors.index.json` names (else `model.safetensors`), so a repository's second
    copy (Mistral's `consolidated.safetensors`) is never fetched. `weights=False`: the configs
    and tokenizer alone."""
    ref = parse(text)
    if ref is None:
        return None
    folder = download(ref, "model", TOKENIZER_FILES, flag)
    if not weights:
        return folder
    if _COMMIT.fullmatch(folder.name):  # the same commit for the weights
        ref = HubRef(ref.repo, folder.name)
    index = folder / "model.safetensors.index.json"
    shards = ["model.safetensors"]
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(
                f"{flag} {text}: {index.name} is not a safetensors index ({e!r}); pick another "
                "revision of the repository"
            ) from e
    folder = download(ref, "model", [*TOKENIZER_FILES, *shards], flag, quiet=True)
    if not all((folder / name).is_file() for name in shards):
        raise UserError(
            f"{flag} {text}: the repository has no {shards[0] if len(shards) == 1 else 'shards'} "
            "of safetensors weights (compiletune does not read .bin/.pth pickles); pick a "
            "repository or revision with safetensors files"
        )
    return folder


def dataset_files(ref: HubRef, flag: str = "--data") -> list[str]:
    """The repository's file paths at `ref` (listed on the Hub, or from the cache's listing
    when offline or pinned to a commit)."""
    hub = _hub()
    try:
        cached_tree = getattr(hub, "get_cached_repo_tree", None)  # huggingface_hub 2.x
        if offline() or (ref.revision and _COMMIT.fullmatch(ref.revision)):
            try:
                if cached_tree is None:
                    raise LookupError("no cached listings in this huggingface_hub")
                files = cached_tree(
                    ref.repo, repo_type="dataset", revision=ref.revision, cache_dir=cache_dir()
                )
                return [f.path for f in files]
            except (LookupError, getattr(hub.errors, "CachedRepoTreeNotFoundError", LookupError)):
                if offline():  # a snapshot written without a listing: its files
                    folder = Path(
                        hub.snapshot_download(
                            ref.repo,
                            repo_type="dataset",
                            revision=ref.revision,
                            cache_dir=str(cache_dir()),
                            local_files_only=True,
                        )
                    )
                    return [
                        p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
                    ]
        timeout = _with_timeouts(hub)
        print(
            f"{flag} {ref}: asking {endpoint()} for the dataset's file list (timeout "
            f"{timeout:g}s, HF_HUB_ETAG_TIMEOUT)",
            file=sys.stderr,
            flush=True,
        )
        api = hub.HfApi(endpoint=endpoint())
        return list(api.list_repo_files(ref.repo, repo_type="dataset", revision=ref.revision))
    except Exception as e:
        raise explain(e, ref, "dataset", flag) from e
