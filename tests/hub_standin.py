"""A stand-in for the Hugging Face Hub on 127.0.0.1 that answers what `huggingface_hub` sends in `create_repo`,
`upload_folder` / `create_commit` and `hf_hub_download` (and so `from_pretrained("user/name")`), with the Hub's rules:

- `POST /api/repos/create`: a new repository gets an initial commit holding the Hub's default `.gitattributes`; an
  existing one answers 409 (`create_repo(exist_ok=True)` goes on, `exist_ok=False` raises); `private` is recorded
  and a private repository answers only its creator's token.
- `POST /api/models/{repo}/preupload/{rev}`: `"uploadMode": "lfs"` for paths the repository's `.gitattributes`
  routes to LFS (`*.safetensors`, ...), binary samples and files of 10 MiB or more, else `"regular"`; with the
  remote `oid` of a path that exists, so unchanged files are left out of the commit.
- The LFS batch API `POST /{repo}.git/info/lfs/objects/batch` (basic transfer): an upload action whose href is a
  second server on 127.0.0.1 standing for the object storage (S3), and a verify action back on the Hub; an object
  the repository already has gets no action. The storage's `PUT` checks the bytes against the announced sha256.
- `POST /api/models/{repo}/commit/{rev}` (NDJSON): regular files by content, LFS files by pointer (sha256 and size,
  refused when the object was never uploaded), deletions; `create_pr=1` commits to a new `refs/pr/N` branched from
  `rev` and answers the pull request's URL. The commit is applied whole or not at all.
- `HEAD`/`GET /{repo}/resolve/{rev}/{path}` for a branch, `refs/pr/N` or commit id: regular files with `ETag` (git
  blob id), `Content-Length` and `X-Repo-Commit`; LFS files as a 302 to the storage with `X-Linked-Etag` (sha256)
  and `X-Linked-Size`; misses with the `X-Error-Code` `huggingface_hub` turns into its error classes.
- `GET /api/models/{repo}[/revision/{rev}]`: the repository's head commit, privacy and files;
  `GET /api/models/{repo}/tree/{rev}[/{path}]`: its files with their oids, sizes and LFS pointers;
  `GET /api/agent-harnesses`: huggingface_hub's telemetry registry, answered empty.

`faults` makes one step answer an HTTP error (`with hub.failing("lfs_put", 500): ...`), to show what a push does when
it breaks midway. The Xet upload protocol (`hf_xet`) is not served: the client is run with `HF_HUB_DISABLE_XET`, the
path `huggingface_hub` takes without `hf_xet`. Every request is recorded in `requests`; any other one is answered
404 and recorded in `unexpected`.
"""

from __future__ import annotations

import base64
import contextlib
import fnmatch
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

# The Hub's default .gitattributes for a new model repository (the LFS part).
LFS_PATTERNS = ("*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib", "*.lfs.*",
                "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb",
                "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "saved_model/**/*", "*.tar.*",
                "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*")
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024  # the Hub routes files of 10 MiB or more to LFS whatever their name
STEPS = ("create", "preupload", "lfs_batch", "lfs_put", "lfs_verify", "commit", "resolve")


def git_blob_id(content: bytes) -> str:
    """The git object id of a blob: what the Hub reports as a regular file's oid and ETag."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Entry:
    content: bytes
    lfs: bool

    @property
    def oid(self) -> str:
        """sha256 for an LFS file (its pointer's oid), the git blob id for a regular one."""
        return hashlib.sha256(self.content).hexdigest() if self.lfs else git_blob_id(self.content)


@dataclass
class Repo:
    repo_id: str
    private: bool
    owner: str | None  # the Authorization header that created it
    refs: dict[str, str] = field(default_factory=dict)  # branch or refs/pr/N -> commit id
    lfs_objects: set[str] = field(default_factory=set)  # sha256 of the LFS objects uploaded to this repository
    trees: dict[str, dict[str, Entry]] = field(default_factory=dict)  # commit id -> path -> file
    pull_requests: int = 0

    def resolve(self, revision: str) -> str | None:
        """The commit id a branch, `refs/pr/N` or commit id names (None where it names nothing)."""
        if revision in self.refs:
            return self.refs[revision]
        return revision if revision in self.trees else None

    def lfs_paths(self, commit: str) -> list[str]:
        text = self.trees[commit].get(".gitattributes", Entry(b"", False)).content.decode()
        return [line.split()[0] for line in text.splitlines() if "filter=lfs" in line]


class StandInHub:
    """The Hub's API on `url` and its object storage on `storage_url`, both on 127.0.0.1 (see the module's text).

    Attributes:
        repos: repo id -> `Repo` (refs, the tree of every commit, privacy).
        created: the bodies of accepted create-repo requests, in order.
        commits: one dict per commit made through the commit endpoint: `repo_id`, `revision` (the ref it moved),
            `oid`, `parent`, `message`, `files` (path -> bytes, LFS files resolved from the storage), `lfs` (the
            paths sent as LFS pointers) and `pr` (N of `refs/pr/N`, or None).
        objects: the storage's verified LFS objects, sha256 -> bytes (each repository knows its own:
            `Repo.lfs_objects`).
        requests: (server, method, path, Authorization header) of every request, server "hub" or "storage".
        unexpected: the requests answered 404 because the stand-in does not serve them.
        faults: step (one of STEPS) -> [HTTP status, times left or None for always].
    """

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.created: list[dict] = []
        self.commits: list[dict] = []
        self.objects: dict[str, bytes] = {}
        self.requests: list[tuple[str, str, str, str | None]] = []
        self.unexpected: list[tuple[str, str, str, str | None]] = []
        self.faults: dict[str, list] = {}
        self.lock = threading.RLock()
        self._uploaded: dict[str, bytes] = {}  # PUT but not verified yet
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, "hub"))
        self.storage = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, "storage"))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.storage_url = f"http://127.0.0.1:{self.storage.server_address[1]}"
        for server in (self.server, self.storage):
            threading.Thread(target=server.serve_forever, daemon=True).start()

    def close(self):
        for server in (self.server, self.storage):
            server.shutdown()
            server.server_close()

    @contextlib.contextmanager
    def failing(self, step: str, status: int = 500, times: int | None = None):
        """Within the block, `step` answers `status` (`times` times, or always)."""
        assert step in STEPS, step
        self.faults[step] = [status, times]
        try:
            yield self
        finally:
            self.faults.pop(step, None)

    def fault(self, step: str) -> int | None:
        with self.lock:
            if step not in self.faults:
                return None
            status, times = self.faults[step]
            if times is not None:
                if times <= 0:
                    return None
                self.faults[step][1] = times - 1
            return status

    def tree(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The files of `repo_id` at `revision`, path -> bytes."""
        repo = self.repos[repo_id]
        return {path: entry.content for path, entry in repo.trees[repo.resolve(revision)].items()}

    def lfs_files(self, repo_id: str, revision: str = "main") -> set[str]:
        repo = self.repos[repo_id]
        return {path for path, entry in repo.trees[repo.resolve(revision)].items() if entry.lfs}

    def new_repo(self, repo_id: str, *, private: bool, owner: str | None) -> Repo:
        repo = Repo(repo_id, private, owner)
        commit = hashlib.sha1(f"{repo_id}\0initial commit".encode()).hexdigest()
        repo.trees[commit] = {".gitattributes": Entry(GITATTRIBUTES, False)}
        repo.refs["main"] = commit
        self.repos[repo_id] = repo
        return repo

    def upload_mode(self, repo: Repo, commit: str, path: str, size: int, sample: bytes) -> str:
        patterns = repo.lfs_paths(commit)
        by_name = any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path.rsplit("/", 1)[-1], p) for p in patterns)
        return "lfs" if by_name or size >= LFS_SIZE_THRESHOLD or b"\0" in sample else "regular"


def _handler(hub: StandInHub, server: str):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        # -- plumbing ------------------------------------------------------------------------------------------

        def body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", ""):
                parts = []
                while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(parts)
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def reply(self, status: int, payload=None, headers: dict[str, str] | None = None, raw: bytes | None = None):
            body = raw if raw is not None else (b"" if payload is None else json.dumps(payload).encode())
            self.send_response(status)
            if raw is None and payload is not None:
                self.send_header("Content-Type", "application/json")
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def error(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None):
            extra = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {}), **(headers or {})}
            self.reply(status, {"error": message}, extra)

        def not_served(self):
            record = (server, self.command, self.path, self.headers.get("Authorization"))
            hub.unexpected.append(record)
            self.error(404, f"{self.command} {self.path} is not served by the stand-in")

        def repo_for(self, repo_id: str, *, write: bool = False) -> Repo | None:
            """The repository, or None after answering as the Hub does: unknown, or private to another token."""
            auth = self.headers.get("Authorization")
            if write and not auth:
                self.error(401, "Invalid credentials in Authorization header")
                return None
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.private and auth != repo.owner):
                self.error(401 if auth is None else 404, "Repository not found", "RepoNotFound")
                return None
            return repo

        def fail(self, step: str) -> bool:
            status = hub.fault(step)
            if status is not None:
                self.error(status, f"stand-in fault: {step} answers {status}")
                return True
            return False

        def record(self):
            hub.requests.append((server, self.command, self.path, self.headers.get("Authorization")))

        # -- methods -------------------------------------------------------------------------------------------

        def do_HEAD(self):
            self.record()
            if server == "storage":
                return self.storage_get()
            self.hub_get()

        def do_GET(self):
            self.do_HEAD()

        def do_PUT(self):
            self.record()
            raw = self.body()
            if server == "storage" and (match := re.fullmatch(r"/upload/([0-9a-f]{64})", urlsplit(self.path).path)):
                return self.storage_put(match.group(1), raw)
            self.not_served()

        def do_POST(self):
            self.record()
            raw = self.body()
            if server == "storage":
                return self.not_served()
            path, query = urlsplit(self.path).path, parse_qs(urlsplit(self.path).query)
            with hub.lock:
                if path == "/api/repos/create":
                    return self.create(json.loads(raw))
                if path == "/api/validate-yaml":
                    return self.validate_yaml(json.loads(raw))
                if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/([^/]+)", path):
                    return self.preupload(unquote(match.group(1)), unquote(match.group(2)), json.loads(raw))
                if match := re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path):
                    return self.lfs_batch(unquote(match.group(1)), json.loads(raw))
                if match := re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/verify", path):
                    return self.lfs_verify(unquote(match.group(1)), json.loads(raw))
                if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/([^/]+)", path):
                    return self.commit(unquote(match.group(1)), unquote(match.group(2)), raw,
                                       create_pr=query.get("create_pr") == ["1"])
            self.not_served()

        # -- the Hub's API ---------------------------------------------------------------------------------------

        def create(self, body: dict):
            if self.fail("create"):
                return
            auth = self.headers.get("Authorization")
            if not auth:
                return self.error(401, "Invalid credentials in Authorization header")
            repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
            url = f"{hub.url}/{repo_id}"
            if repo_id in hub.repos:
                return self.reply(409, {"error": "You already created this model repo", "url": url},
                                  {"X-Error-Message": "You already created this model repo"})
            hub.new_repo(repo_id, private=body.get("visibility") == "private", owner=auth)
            hub.created.append(body)
            self.reply(200, {"url": url, "name": repo_id, "id": repo_id})

        def validate_yaml(self, body: dict):
            try:
                yaml.safe_load(body["content"].split("---")[1])
            except yaml.YAMLError as error:
                return self.reply(400, {"errors": [{"message": str(error)}]})
            self.reply(200, {"errors": [], "warnings": []})

        def preupload(self, repo_id: str, revision: str, body: dict):
            if self.fail("preupload") or (repo := self.repo_for(repo_id, write=True)) is None:
                return
            commit = repo.resolve(revision)
            if commit is None:
                return self.error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            tree, files = repo.trees[commit], []
            for item in body["files"]:
                sample = base64.b64decode(item["sample"])
                mode = hub.upload_mode(repo, commit, item["path"], item["size"], sample)
                existing = tree.get(item["path"])
                files.append({"path": item["path"], "uploadMode": mode, "shouldIgnore": False,
                              "oid": existing.oid if existing is not None and existing.lfs == (mode == "lfs")
                              else None})
            self.reply(200, {"files": files})

        def lfs_batch(self, repo_id: str, body: dict):
            if self.fail("lfs_batch") or (repo := self.repo_for(repo_id, write=True)) is None:
                return
            assert body["operation"] == "upload" and "basic" in body["transfers"], body
            objects = []
            for item in body["objects"]:
                oid, size = item["oid"], item["size"]
                entry = {"oid": oid, "size": size, "authenticated": True}
                if oid not in repo.lfs_objects:  # an object the repository already has needs no upload
                    entry["actions"] = {
                        "upload": {"href": f"{hub.storage_url}/upload/{oid}?X-Amz-Signature=stand-in",
                                   "header": {}},
                        "verify": {"href": f"{hub.url}/{repo_id}.git/info/lfs/objects/verify",
                                   "header": {"Authorization": self.headers.get("Authorization", "")}},
                    }
                objects.append(entry)
            self.reply(200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
                       {"Content-Type": "application/vnd.git-lfs+json"})

        def lfs_verify(self, repo_id: str, body: dict):
            if self.fail("lfs_verify") or (repo := self.repo_for(repo_id, write=True)) is None:
                return
            oid, size = body["oid"], body["size"]
            content = hub._uploaded.get(oid, hub.objects.get(oid))
            if content is None or len(content) != size:
                return self.error(404, f"object {oid} of {size} bytes was not uploaded")
            hub.objects[oid] = hub._uploaded.pop(oid, content)
            repo.lfs_objects.add(oid)
            self.reply(200, {"oid": oid, "size": size})

        def commit(self, repo_id: str, revision: str, raw: bytes, *, create_pr: bool):
            if self.fail("commit") or (repo := self.repo_for(repo_id, write=True)) is None:
                return
            base = repo.resolve(revision)
            if base is None or (revision not in repo.refs and not create_pr):
                return self.error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            lines = [json.loads(line) for line in raw.decode().splitlines() if line]
            header = next(item["value"] for item in lines if item["key"] == "header")
            if header.get("parentCommit") and header["parentCommit"] != base:
                return self.error(412, "A commit has happened since. Please refresh and try again.")
            tree, files, lfs = dict(repo.trees[base]), {}, set()
            for item in lines:
                key, value = item["key"], item["value"]
                if key == "file":
                    files[value["path"]] = tree[value["path"]] = Entry(base64.b64decode(value["content"]), False)
                elif key == "lfsFile":
                    content = hub.objects.get(value["oid"]) if value["oid"] in repo.lfs_objects else None
                    if content is None or ("size" in value and len(content) != value["size"]):
                        return self.error(422, f"Your push was rejected because an LFS pointer pointed to a file "
                                               f"that does not exist: {value['path']} ({value['oid']})")
                    files[value["path"]] = tree[value["path"]] = Entry(content, True)
                    lfs.add(value["path"])
                elif key == "deletedFile":
                    tree.pop(value["path"], None)
                elif key == "deletedFolder":
                    tree = {p: e for p, e in tree.items() if not p.startswith(value["path"].rstrip("/") + "/")}
                elif key != "header":
                    return self.error(400, f"unknown commit operation {key!r}")
            oid = hashlib.sha1(json.dumps([base, header, sorted((p, e.oid) for p, e in tree.items())]).encode()
                               + str(len(hub.commits)).encode()).hexdigest()
            pr = None
            if create_pr:
                repo.pull_requests += 1
                pr = repo.pull_requests
                ref = f"refs/pr/{pr}"
            else:
                ref = revision
            repo.trees[oid] = tree
            repo.refs[ref] = oid
            hub.commits.append({"repo_id": repo_id, "revision": ref, "oid": oid, "parent": base,
                                "message": header["summary"], "files": {p: e.content for p, e in files.items()},
                                "lfs": lfs, "pr": pr})
            self.reply(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{oid}", "commitOid": oid,
                             "pullRequestUrl": f"{hub.url}/{repo_id}/discussions/{pr}" if pr else None})

        def hub_get(self):
            path = urlsplit(self.path).path
            with hub.lock:
                if match := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                    return self.resolve(unquote(match.group(1)), unquote(match.group(2)), unquote(match.group(3)))
                if self.command == "GET" and (
                        match := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)):
                    return self.repo_info(unquote(match.group(1)), unquote(match.group(2) or "main"))
                if self.command == "GET" and (
                        match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.+))?", path)):
                    recursive = parse_qs(urlsplit(self.path).query).get("recursive") == ["true"]
                    return self.list_tree(unquote(match.group(1)), unquote(match.group(2)),
                                          unquote(match.group(3) or ""), recursive=recursive)
                if self.command == "GET" and path == "/api/agent-harnesses":  # huggingface_hub's telemetry registry
                    return self.reply(200, {"standardEnvVars": [], "harnesses": {}})
            self.not_served()

        def resolve(self, repo_id: str, revision: str, filename: str):
            if self.fail("resolve") or (repo := self.repo_for(repo_id)) is None:
                return
            commit = repo.resolve(revision)
            if commit is None:
                return self.error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            entry = repo.trees[commit].get(filename)
            if entry is None:
                return self.error(404, f"Entry not found: {filename}", "EntryNotFound", {"X-Repo-Commit": commit})
            headers = {"X-Repo-Commit": commit, "ETag": f'"{entry.oid}"', "Accept-Ranges": "bytes"}
            if entry.lfs:  # the Hub sends LFS files from the storage: the redirect carries their metadata
                headers.update({"Location": f"{hub.storage_url}/{entry.oid}", "X-Linked-Etag": f'"{entry.oid}"',
                                "X-Linked-Size": str(len(entry.content))})
                return self.reply(302, raw=b"", headers=headers)
            self.reply(200, raw=entry.content, headers=headers)

        def repo_info(self, repo_id: str, revision: str):
            if (repo := self.repo_for(repo_id)) is None:
                return
            commit = repo.resolve(revision)
            if commit is None:
                return self.error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            self.reply(200, {"id": repo_id, "modelId": repo_id, "sha": commit, "private": repo.private,
                             "siblings": [{"rfilename": p} for p in sorted(repo.trees[commit])]})

        def list_tree(self, repo_id: str, revision: str, folder: str, *, recursive: bool):
            if (repo := self.repo_for(repo_id)) is None:
                return
            commit = repo.resolve(revision)
            if commit is None:
                return self.error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            prefix = folder.strip("/") + "/" if folder.strip("/") else ""
            entries, folders = [], set()
            for path, entry in sorted(repo.trees[commit].items()):
                if not path.startswith(prefix):
                    continue
                parts = path[len(prefix):].split("/")
                folders.update(prefix + "/".join(parts[:i]) for i in range(1, len(parts) if recursive else 2)
                               if i < len(parts))
                if recursive or len(parts) == 1:
                    item = {"type": "file", "oid": entry.oid, "size": len(entry.content), "path": path}
                    if entry.lfs:
                        pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{entry.oid}\n"
                                   f"size {len(entry.content)}\n").encode()
                        item["oid"] = git_blob_id(pointer)
                        item["lfs"] = {"oid": entry.oid, "size": len(entry.content), "pointerSize": len(pointer)}
                    entries.append(item)
            if not entries and not folders:
                return self.error(404, f"{folder} does not exist on {revision}", "EntryNotFound",
                                  {"X-Repo-Commit": commit})
            directories = [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                           for d in sorted(folders)]
            self.reply(200, directories + entries)

        # -- the object storage ----------------------------------------------------------------------------------

        def storage_put(self, oid: str, raw: bytes):
            if self.fail("lfs_put"):
                return
            if hashlib.sha256(raw).hexdigest() != oid:
                return self.error(400, "the content does not match its sha256")
            with hub.lock:
                hub._uploaded[oid] = raw
            self.reply(200, raw=b"", headers={"ETag": f'"{hashlib.md5(raw).hexdigest()}"'})

        def storage_get(self):
            oid = urlsplit(self.path).path.lstrip("/")
            content = hub.objects.get(oid)
            if content is None:
                return self.error(404, "NoSuchKey")
            self.reply(200, raw=content, headers={"ETag": f'"{oid}"', "Content-Type": "application/octet-stream"})

    Handler.__name__ = f"StandIn{server.title()}Handler"
    return Handler
