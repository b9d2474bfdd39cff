"""A local HTTP server posing as the Hugging Face hub (point HF_ENDPOINT at it), serving the
few endpoints `huggingface_hub` downloads a model through: repo info, the recursive file tree,
and HEAD/GET of `resolve` URLs, with byte ranges (so a partial download can resume).

`slow` names files sent in small chunks with pauses (so a test can interrupt a download
half-way); `drop_after` cuts the connection once after that many bytes of a file (a network
failure mid-file); `claimed_sizes` makes the tree listing claim another size for a file (a model too
big for the disk); `requests` records (method, path, Range header) of every request, and
`downloads()` picks the file transfers out of them.

Uploads (what `huggingface_hub`'s `create_repo` + `create_commit` send): `POST /api/repos/create`,
`POST /api/models/{repo}/preupload/{rev}` (every file "regular": its bytes travel base64 in the
commit) and `POST /api/models/{repo}/commit/{rev}` (NDJSON). Only a bearer token in
`write_tokens` may write (else 401, as the hub answers a bad token); `refused_namespaces` answer
403 (a namespace the token may not write); `private` and `commits` record what was pushed."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.slow: set[str] = set()
        self.drop_after: dict[str, int] = {}
        self.claimed_sizes: dict[str, int] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.write_tokens: set[str] = {"hf_fake_write_token"}
        self.refused_namespaces: set[str] = set()
        self.private: dict[str, bool] = {}
        self.commits: dict[str, list[str]] = {}  # repo -> commit messages, oldest first
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def downloads(self) -> list[tuple[str, str | None]]:
        """(path, Range header) of every GET of a file that fetches it to its end: a whole-file
        transfer or a resume ("bytes=N-"), not a bounded read such as a safetensors header."""
        return [(path, ranged) for method, path, ranged in list(self.requests)
                if method == "GET" and "/resolve/" in path
                and (ranged is None or ranged.endswith("-"))]  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self):  # -> FakeHub
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def do_POST(self) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, None))
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if path == "/api/validate-yaml":  # a commit with a README.md checks its metadata
                    return self._json(200, {"errors": [], "warnings": []})
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                if token not in hub.write_tokens:
                    return self._json(401, {"error": "Invalid credentials in Authorization header"})
                parts = path.strip("/").split("/")
                if parts == ["api", "repos", "create"]:
                    return self._create(json.loads(body))
                if parts[:2] == ["api", "models"] and len(parts) >= 6:
                    repo = f"{parts[2]}/{parts[3]}"
                    if repo not in hub.repos:
                        return self._json(404, {"error": "Repository not found"},
                                          {"X-Error-Code": "RepoNotFound"})
                    if parts[4] == "preupload":
                        files = json.loads(body)["files"]
                        return self._json(200, {"files": [
                            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                            for f in files]})
                    if parts[4] == "commit":
                        return self._commit(repo, body)
                self._json(404, {"error": "not found"})

            def _create(self, payload: dict) -> None:
                org, name = payload.get("organization"), payload["name"]
                repo = f"{org}/{name}"
                if org in hub.refused_namespaces:
                    return self._json(403, {"error": f"You don't have the rights to create a "
                                            f"model under the namespace \"{org}\""})
                url = f"{hub.url}/{repo}"
                if repo in hub.repos:
                    return self._json(409, {"error": "You already created this model repo",
                                            "url": url})
                hub.repos[repo] = {}
                hub.private[repo] = payload.get("visibility", "public") == "private" or bool(
                    payload.get("private"))
                hub.commits[repo] = []
                self._json(200, {"url": url})

            def _commit(self, repo: str, body: bytes) -> None:
                message = ""
                for line in body.decode().splitlines():
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    if item["key"] == "header":
                        message = item["value"].get("summary", "")
                    elif item["key"] == "file":
                        value = item["value"]
                        hub.repos[repo][value["path"]] = base64.b64decode(value["content"])
                hub.commits[repo].append(message)
                oid = hashlib.sha1(f"{repo}{len(hub.commits[repo])}".encode()).hexdigest()
                self._json(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid})

            def _serve(self, body: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"]:
                    return self._api(parts[2:])
                # /{org}/{name}/resolve/{revision}/{file...}
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._file(f"{parts[0]}/{parts[1]}", "/".join(parts[4:]), body)
                self._json(404, {"error": "not found"})

            def _api(self, parts: list[str]) -> None:
                repo = "/".join(parts[:2])
                files = hub.repos.get(repo)
                if files is None:
                    return self._json(
                        404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}
                    )
                if len(parts) >= 3 and parts[2] == "tree":
                    return self._json(200, [_tree_entry(hub, n, d) for n, d in files.items()])
                self._json(
                    200,
                    {
                        "id": repo, "modelId": repo, "sha": COMMIT,
                        "private": hub.private.get(repo, False),
                        "siblings": [{"rfilename": name} for name in files],
                    },
                )  # fmt: skip

            def _file(self, repo: str, name: str, body: bool) -> None:
                data = hub.repos.get(repo, {}).get(name)
                if data is None:
                    return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
                start, end = 0, len(data) - 1
                ranged = self.headers.get("Range")
                if ranged and ranged.startswith("bytes="):
                    first, _, last = ranged[len("bytes=") :].partition("-")
                    start = int(first)
                    end = min(int(last), end) if last else end
                chunk = data[start : end + 1]
                self.send_response(206 if ranged else 200)
                self.send_header("Content-Length", str(len(chunk)))
                self.send_header("ETag", f'"{_oid(data)}"')
                self.send_header("X-Repo-Commit", COMMIT)
                if ranged:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if not body:
                    return
                try:
                    # a whole-file transfer is the one cut off; a resume or a header read is not
                    cut = hub.drop_after.pop(name, None) if not ranged else None
                    if cut is not None:
                        self.wfile.write(chunk[:cut])
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    if name in hub.slow:
                        for i in range(0, len(chunk), 65536):
                            self.wfile.write(chunk[i : i + 65536])
                            self.wfile.flush()
                            time.sleep(0.1)
                    else:
                        self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away mid-file (an interrupted download)

            def _json(self, status: int, data: object, headers: dict[str, str] | None = None):
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(raw)

        return Handler


def _oid(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _tree_entry(hub: FakeHub, name: str, data: bytes) -> dict:
    return {"type": "file", "oid": _oid(data), "size": hub.claimed_sizes.get(name, len(data)),
            "path": name}  # fmt: skip
