"""Code bundle uploads: POST /api/v1/code/ (multipart, one .tar.gz in the field `file`) and
GET /api/v1/code/<digest>/.

The upload never sits in memory: BundleUploadHandler, installed before anything reads the body
(the session CSRF check included), streams the one file to a temporary file under
<artifact root>/bundles/.incoming/ (a unique O_EXCL name, no symlink followed) while hashing it, and stops as soon as it passes
TRAINYARD_BUNDLE_MAX_BYTES (a request whose Content-Length is over the limit is refused before
its body is read). jobs.bundles.services then inspects and stores it. Under daphne,
`UploadSizeGuard` answers an oversized or length-less upload with 413/411 before Django spools
the body to disk at all.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

from django.core.files.uploadedfile import UploadedFile
from django.core.files.uploadhandler import FileUploadHandler, StopUpload
from django.http import QueryDict
from django.utils.datastructures import MultiValueDict
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs.bundles import services
from jobs.core.errors import InvalidInput, NotFound, PayloadTooLarge, Unavailable
from jobs.models import CodeBundle
from jobs.bundles import services as bundle_services
from trainyard.bundle import is_digest
from trainyard.safefs import UnsafePath

log = logging.getLogger(__name__)

FIELD = "file"
MULTIPART_OVERHEAD = 64 * 1024
"""Bytes a multipart body may carry beyond the file itself (boundaries, part headers)."""
UPLOAD_PATH = "/api/v1/code/"


def _too_big_message(limit: int) -> str:
    return f"the bundle is over {limit} bytes packed (TRAINYARD_BUNDLE_MAX_BYTES)"


class BundleUpload(UploadedFile):
    """The received file: on disk under .incoming/ (deleted when closed) with its sha256."""

    def __init__(self, file, *, name: str, size: int, digest: str, content_type: str | None):
        super().__init__(file, name=name, content_type=content_type, size=size)
        self.digest = digest

    def temporary_file_path(self) -> str:
        return str(self.file.path)


class BundleUploadHandler(FileUploadHandler):
    """Streams the field `file` to disk while hashing; other file fields are counted and dropped."""

    chunk_size = 256 * 1024

    def __init__(self, request, limit: int):
        super().__init__(request)
        self.limit = limit
        self.too_big = False
        self.other_files: list[str] = []
        self._temp = None
        self._active = False
        self._received = 0
        self._sha = hashlib.sha256()

    def handle_raw_input(self, input_data, META, content_length, boundary, encoding=None):
        if content_length and content_length > self.limit + MULTIPART_OVERHEAD:
            self.too_big = True
            return QueryDict(mutable=True), MultiValueDict()  # parsed as empty: the body is never read
        return None

    def new_file(self, field_name, file_name, *args, **kwargs):
        super().new_file(field_name, file_name, *args, **kwargs)
        self._active = field_name == FIELD and self._temp is None
        if not self._active:
            self.other_files.append(field_name)
            return
        # a unique O_EXCL file in a real .incoming/ directory (no link followed: the root is shared with the nodes)
        self._temp = bundle_services.IncomingUpload()

    def receive_data_chunk(self, raw_data, start):
        if not self._active:
            return None
        self._received += len(raw_data)
        if self._received > self.limit:
            self.too_big = True
            self.discard()
            raise StopUpload(connection_reset=False)
        self._sha.update(raw_data)
        self._temp.write(raw_data)
        return None

    def file_complete(self, file_size):
        if not self._active:
            return None
        self._active = False
        self._temp.flush()
        os.fsync(self._temp.fileno())
        self._temp.seek(0)
        return BundleUpload(self._temp, name=self.file_name, size=self._received,
                            digest="sha256:" + self._sha.hexdigest(), content_type=self.content_type)

    def upload_interrupted(self):
        self.discard()

    def discard(self) -> None:
        self._active = False
        if self._temp is not None:
            self._temp.close()


class CodeUploadView(APIView):
    parser_classes = [MultiPartParser]

    def initialize_request(self, request, *args, **kwargs):
        # Before authentication: the session CSRF check reads the body too, and must read it through this.
        if request.method == "POST":
            handler = BundleUploadHandler(request, bundle_services.bundle_limits().max_bytes)
            request.upload_handlers = [handler]
            request.bundle_upload_handler = handler
        return super().initialize_request(request, *args, **kwargs)

    @extend_schema(request={"multipart/form-data": {"type": "object", "properties": {
        FIELD: {"type": "string", "format": "binary"}}, "required": [FIELD]}},
        responses={201: {"type": "object"}, 200: {"type": "object"}, 400: {"type": "object"}, 413: {"type": "object"}})
    def post(self, request):
        """Store a code bundle: 201 {"bundle", "bytes", "files"}; 200 when it was already stored."""
        handler: BundleUploadHandler = request._request.bundle_upload_handler
        try:
            files = request.FILES
        except UnsafePath as exc:  # .incoming/ replaced by a link or a file: refused, never written through
            raise _unsafe_store(exc) from None
        uploads = files.getlist(FIELD)
        try:
            if handler.too_big:
                raise PayloadTooLarge({FIELD: [_too_big_message(handler.limit)]})
            if len(uploads) != 1 or handler.other_files or len(files) != len(uploads):
                raise InvalidInput({FIELD: ["send exactly one .tar.gz file, in the multipart field 'file'"]})
            upload: BundleUpload = uploads[0]
            bundle, created = services.bundle_store(user=request.user, upload=upload.file, digest=upload.digest)
        except UnsafePath as exc:  # a bucket directory replaced by a link: refused, never written through
            raise _unsafe_store(exc) from None
        finally:
            for upload in uploads:
                upload.close()
            handler.discard()
        return Response(bundle_dict(bundle), status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


def _unsafe_store(exc: OSError) -> Unavailable:
    log.error("code upload refused: a directory of the bundle store is a link or not a directory: %s", exc)
    return Unavailable({FIELD: ["the bundle store is unavailable (one of its directories was found replaced by a "
                                "link, and is not written through); tell the operator"]})


class CodeDetailView(APIView):
    @extend_schema(responses={200: {"type": "object"}})
    def get(self, request, digest: str):
        """A stored bundle's metadata."""
        if not is_digest(digest):
            raise NotFound({"bundle": [f"{digest!r} is not a bundle id (sha256:<64 hex digits>)"]})
        bundle = CodeBundle.objects.filter(digest=digest).first()
        if bundle is None:
            raise NotFound({"bundle": [f"no bundle {digest} is stored"]})
        return Response(bundle_dict(bundle, detail=True))


def bundle_dict(bundle: CodeBundle, *, detail: bool = False) -> dict:
    out = {"bundle": bundle.digest, "bytes": bundle.bytes, "files": bundle.files}
    if detail:
        out.update(created_at=bundle.created_at.isoformat(),
                   last_used_at=bundle.last_used_at.isoformat() if bundle.last_used_at else None)
    return out


class UploadSizeGuard:
    """ASGI middleware: a POST to /api/v1/code/ without a Content-Length (411) or with one over the
    packed limit (413) is answered at once, before Django reads (and spools) its body; with
    `body_limit`, a request to any other path whose Content-Length is over it is a 413 too (under
    daphne, controlplane/daphne_bodies.py already refused both before the body was received)."""

    def __init__(self, app, limit: int, body_limit: int | None = None):
        self.app, self.limit, self.body_limit = app, limit, body_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.body_limit is not None and scope.get("path") != UPLOAD_PATH:
            raw = dict(scope.get("headers") or []).get(b"content-length", b"")
            if raw.isdigit() and int(raw) > self.body_limit:
                await _answer(send, 413, {"errors": {"detail": [
                    f"the request body is {int(raw)} bytes; the largest accepted is {self.body_limit} "
                    "(TRAINYARD_HTTP_MAX_BODY_BYTES)"]}})
                return
        if scope["type"] == "http" and scope.get("method") == "POST" and scope.get("path") == UPLOAD_PATH:
            headers = dict(scope.get("headers") or [])
            raw = headers.get(b"content-length")
            refusal = None
            if raw is None or not raw.isdigit():
                refusal = 411, "send the bundle with a Content-Length"
            elif int(raw) > self.limit + MULTIPART_OVERHEAD:
                refusal = 413, _too_big_message(self.limit)
            if refusal is not None:
                await _answer(send, refusal[0], {"errors": {FIELD: [refusal[1]]}})
                return
        await self.app(scope, receive, send)


async def _answer(send, code: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": code, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})
