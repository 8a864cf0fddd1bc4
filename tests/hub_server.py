"""A small stand-in for the Hugging Face Hub on the loopback address, for tests.

It speaks the part of the Hub's protocol that huggingface_hub's downloads use: repository
info (`/api/{models,datasets}/ORG/NAME/revision/REV`), the recursive file listing
(`/api/.../tree/REV`), and file resolution (`HEAD`/`GET /[datasets/]ORG/NAME/resolve/REV/PATH`
with `X-Repo-Commit`, `ETag`, `Content-Length` and byte ranges for resumed downloads;
`drop_once` cuts a file's first transfer short; `silent` answers nothing at all). Errors
carry the Hub's `X-Error-Code` header (RepoNotFound, GatedRepo, RevisionNotFound,
EntryNotFound). Every request is recorded in `requests` as (method, path, Range header).
Point `HF_ENDPOINT` at `url`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = ""
    branches: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    private: bool = False  # needs an Authorization header; 401 without one

    def __post_init__(self) -> None:
        if not self.commit:
            digest = hashlib.sha1()
            for name in sorted(self.files):
                digest.update(name.encode() + b"\0" + self.files[name])
            self.commit = digest.hexdigest()
        self.branches.setdefault("main", self.commit)


def folder_files(folder: Path) -> dict[str, bytes]:
    """A local folder's files by their path inside it (what a repo holds)."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def etag(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


class HubServer:
    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}  # (kind, "org/name") -> repo
        self.requests: list[tuple[str, str, str | None]] = []
        # file path -> bytes sent before the connection drops, once (a network failure)
        self.drop_once: dict[str, int] = {}
        # silent: every request is read and never answered (until `release` is set at close)
        self.silent = False
        self.silent_requests = threading.Event()
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                server._serve(self, body=False)

            def do_GET(self) -> None:
                server._serve(self, body=True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def add(self, kind: str, name: str, repo: Repo) -> Repo:
        self.repos[(kind, name)] = repo
        return repo

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def file_gets(self) -> list[str]:
        """The paths of file downloads (GETs of /resolve/) so far."""
        return [p for m, p, _ in self.requests if m == "GET" and "/resolve/" in p]

    # -- protocol -------------------------------------------------------------------------

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Range")))
        if self.silent:  # accepts the connection, reads the request, never answers
            self.silent_requests.set()
            self.release.wait()
            return
        parts = path.strip("/").split("/")
        if parts[0] == "api":  # /api/models/ORG/NAME[/(revision|tree)/REV[/...]]
            kind = parts[1][:-1]
            # (the info of the default branch has no /revision/REV part)
            name, action, rest = "/".join(parts[2:4]), (parts[4:5] or ["revision"])[0], parts[5:]
        else:  # [datasets/]ORG/NAME/resolve/REV/PATH
            kind = "dataset" if parts[0] == "datasets" else "model"
            parts = parts[1:] if kind == "dataset" else parts
            name, action, rest = "/".join(parts[:2]), parts[2], parts[3:]
        repo = self.repos.get((kind, name))
        if repo is None:
            return self._error(h, 404, "RepoNotFound", "Repository not found")
        if repo.private and not h.headers.get("Authorization"):
            return self._error(h, 401, "RepoNotFound", "Invalid username or password.")
        if repo.gated and action == "resolve":
            return self._error(h, 403, "GatedRepo", "Access to this model is restricted.")
        revision = rest[0] if rest else "main"
        commit = repo.branches.get(revision, revision if revision == repo.commit else None)
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if action == "revision":
            siblings = [{"rfilename": f, "size": len(d)} for f, d in sorted(repo.files.items())]
            return self._json(h, {"id": name, "sha": commit, "siblings": siblings}, body)
        if action == "tree":
            entries = [
                {"type": "file", "path": f, "size": len(data), "oid": etag(data)}
                for f, data in sorted(repo.files.items())
            ]
            return self._json(h, entries, body)
        filename = "/".join(rest[1:])
        data = repo.files.get(filename)
        if data is None:
            return self._error(h, 404, "EntryNotFound", f"{filename} does not exist", commit)
        start = 0
        ranged = h.headers.get("Range")
        if ranged and ranged.startswith("bytes="):
            start = int(ranged[6:].split("-")[0])
        chunk = data[start:]
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", commit)
        h.send_header("ETag", f'"{etag(data)}"')
        h.send_header("Content-Length", str(len(chunk)))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        cut = self.drop_once.pop(filename, None) if body else None
        if cut is not None:
            h.wfile.write(chunk[:cut])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # the rest never comes
        elif body:
            h.wfile.write(chunk)

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, value: object, body: bool) -> None:
        data = json.dumps(value).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    @staticmethod
    def _error(
        h: BaseHTTPRequestHandler, status: int, code: str, message: str, commit: str = ""
    ) -> None:
        data = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)
