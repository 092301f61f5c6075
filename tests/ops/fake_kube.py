"""A stand-in for the Kubernetes API server, for `deltaserve ops --k8s` (no real one runs here).

It serves just what the ops commands use: GET and PATCH (``application/merge-patch+json``) of a
RayService at ``/apis/ray.io/v1/namespaces/<ns>/rayservices/<name>``, behind a bearer token. Each
PATCH is checked as the API server (with strict field validation) and KubeRay would check it:

- the body must be a valid partial RayService (the KubeRay CRD's ``openAPIV3Schema``, strict, with
  ``required`` lifted since a merge patch carries only what changes);
- ``metadata.resourceVersion``, when the body carries one, must be the stored one (else 409);
- the merged object must validate against the full CRD schema, and its ``spec.serveConfigV2`` YAML
  against Ray's ``ServeDeploySchema``;

a body that fails gets 422 with the reasons, and nothing is stored. Every PATCH body is kept
(:attr:`FakeKube.patches`) with the verdict, for the tests to read.
"""

from __future__ import annotations

import copy
import json
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import yaml

from tests.k8s.test_manifests import crd_validator

PREFIX = "/apis/ray.io/v1/namespaces/"


def _partial(schema):
    """The CRD schema for a merge-patch body: the same types and fields, nothing required."""
    if isinstance(schema, dict):
        return {k: _partial(v) for k, v in schema.items() if k != "required"}
    if isinstance(schema, list):
        return [_partial(v) for v in schema]
    return schema


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch: objects merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _errors(validator: jsonschema.Draft7Validator, obj) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]


def serve_config_errors(text: object) -> list[str]:
    """Why ``text`` is not a Serve config KubeRay could apply ([] if it is)."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    if not isinstance(text, str):
        return [f"spec.serveConfigV2: must be a YAML string, got {type(text).__name__}"]
    try:
        ServeDeploySchema.model_validate(yaml.safe_load(text))
    except (yaml.YAMLError, ValidationError) as e:
        return [f"spec.serveConfigV2: {e}"]
    return []


@dataclass
class Patch:
    path: str
    content_type: str
    body: object
    errors: list[str] = field(default_factory=list)  # [] : accepted


class FakeKube:
    """The fake API server on 127.0.0.1 (a free port), in a thread; :meth:`put` seeds objects."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self.objects: dict[tuple[str, str], dict] = {}
        self.patches: list[Patch] = []
        self.gets = 0
        self._lock = threading.Lock()
        self._version = 1
        self._full = crd_validator("ray.io/v1", "RayService")
        self._patch = jsonschema.Draft7Validator(_partial(self._full.schema))
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "FakeKube":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def put(self, obj: dict) -> dict:
        """Store ``obj`` (a RayService) as the API server would after a create: a new resourceVersion."""
        meta = obj["metadata"]
        with self._lock:
            self._version += 1
            stored = copy.deepcopy(obj)
            stored["metadata"]["resourceVersion"] = str(self._version)
            self.objects[meta["namespace"], meta["name"]] = stored
            return copy.deepcopy(stored)

    def get(self, namespace: str, name: str) -> dict:
        with self._lock:
            return copy.deepcopy(self.objects[namespace, name])

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig file whose current context is this server with its token."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "ops", "user": {"token": self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "ops"}}]}))
        return path

    # -- requests ------------------------------------------------------------------------------
    def _key(self, path: str) -> tuple[str, str] | None:
        if not path.startswith(PREFIX):
            return None
        parts = path[len(PREFIX):].split("/")
        return (parts[0], parts[2]) if len(parts) == 3 and parts[1] == "rayservices" else None

    def _apply_patch(self, key: tuple[str, str], patch: Patch) -> tuple[int, dict]:
        body = patch.body
        if patch.content_type != "application/merge-patch+json":
            patch.errors = [f"content type {patch.content_type!r}: only application/merge-patch+json is served here"]
            return 415, _status(415, "UnsupportedMediaType", patch.errors)
        patch.errors = _errors(self._patch, body) if isinstance(body, dict) else ["body: must be a JSON object"]
        with self._lock:
            stored = self.objects.get(key)
            if stored is None:
                return 404, _status(404, "NotFound", [f"rayservices.ray.io {key[1]!r} not found"])
            version = ((body.get("metadata") or {}) if isinstance(body, dict) else {}).get("resourceVersion")
            if not patch.errors and version is not None and version != stored["metadata"]["resourceVersion"]:
                patch.errors = [f"resourceVersion {version} is stale (now {stored['metadata']['resourceVersion']})"]
                return 409, _status(409, "Conflict", patch.errors)
            merged = merge_patch(stored, body) if not patch.errors else stored
            if not patch.errors:
                patch.errors = _errors(self._full, merged) + serve_config_errors(merged.get("spec", {}).get("serveConfigV2"))
            if patch.errors:
                return 422, _status(422, "Invalid", patch.errors)
            self._version += 1
            merged["metadata"]["resourceVersion"] = str(self._version)
            self.objects[key] = merged
            return 200, copy.deepcopy(merged)

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _reply(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if self.headers.get("Authorization") == f"Bearer {fake.token}":
                    return True
                self._reply(401, _status(401, "Unauthorized", ["no valid bearer token"]))
                return False

            def do_GET(self) -> None:
                if not self._authorized():
                    return
                key = fake._key(self.path.split("?")[0])
                with fake._lock:
                    fake.gets += 1
                    obj = copy.deepcopy(fake.objects.get(key)) if key else None
                if obj is None:
                    self._reply(404, _status(404, "NotFound", [f"{self.path} not found"]))
                else:
                    self._reply(200, obj)

            def do_PATCH(self) -> None:
                if not self._authorized():
                    return
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = raw.decode(errors="replace")
                patch = Patch(self.path, (self.headers.get("Content-Type") or "").split(";")[0], body)
                key = fake._key(self.path.split("?")[0])
                with fake._lock:
                    fake.patches.append(patch)
                if key is None:
                    patch.errors = [f"{self.path}: not a RayService"]
                    self._reply(404, _status(404, "NotFound", patch.errors))
                    return
                self._reply(*fake._apply_patch(key, patch))

        return Handler


def _status(code: int, reason: str, causes: list[str]) -> dict:
    """A Kubernetes ``Status`` object, as the API server answers an error."""
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": "; ".join(causes), "details": {"causes": [{"message": c} for c in causes]}}
