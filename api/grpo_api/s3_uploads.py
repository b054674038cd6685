"""Incomplete multipart uploads on S3: list them under a prefix and abort them.

A writer killed in the middle of a large upload leaves its parts on the server (invisible, but
stored and billed) until the upload is aborted. pyarrow's S3 file system has no call for these,
so the two requests are made here, signed with AWS Signature Version 4 (standard library only:
no boto3). The endpoint, region and credentials are the ones `Storage` uses.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from urllib.parse import quote, urlparse

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def _children(el: ET.Element, tag: str) -> list[ET.Element]:
    """Children named `tag`, with or without S3's XML namespace (servers differ)."""
    return [c for c in el if c.tag.rsplit("}", 1)[-1] == tag]


def _text(el: ET.Element, tag: str) -> str:
    found = _children(el, tag)
    return (found[0].text or "") if found else ""


@dataclass(frozen=True)
class Upload:
    key: str
    upload_id: str
    initiated: datetime.datetime


@dataclass(frozen=True)
class S3Client:
    endpoint: str | None
    """http(s)://host:port of an S3-compatible server (path-style addressing); None: AWS."""
    region: str
    access_key: str
    secret_key: str
    session_token: str | None = None

    def _url(self, bucket: str, key: str) -> tuple[str, str, str]:
        """(scheme, host, path) of an object or bucket URL."""
        if self.endpoint:
            url = urlparse(self.endpoint)
            return url.scheme, url.netloc, f"/{bucket}/{key}" if key else f"/{bucket}"
        return "https", f"{bucket}.s3.{self.region}.amazonaws.com", f"/{key}"

    def _request(self, method: str, bucket: str, key: str, query: dict[str, str]) -> bytes:
        scheme, host, path = self._url(bucket, key)
        now = datetime.datetime.now(datetime.timezone.utc)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        headers = {"host": host, "x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": amz_date}
        if self.session_token:
            headers["x-amz-security-token"] = self.session_token
        canonical_path = quote(path, safe="/-_.~")
        canonical_query = "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(query.items()))
        signed = ";".join(sorted(headers))
        canonical = "\n".join([method, canonical_path, canonical_query,
                               "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)), signed, _EMPTY_SHA256])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        key_ = f"AWS4{self.secret_key}".encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key_ = hmac.new(key_, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key_, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
                                    f"SignedHeaders={signed}, Signature={signature}")
        url = f"{scheme}://{host}{canonical_path}" + (f"?{canonical_query}" if canonical_query else "")
        req = urllib.request.Request(url, method=method, headers={k: v for k, v in headers.items() if k != "host"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.read()
        except urllib.error.HTTPError as exc:
            # Storage's retry tries a plain OSError again and raises the others at once.
            message = f"{method} {bucket}/{key}: HTTP {exc.code}: {exc.read()[:300]!r}"
            if exc.code in (408, 429) or exc.code >= 500:
                raise OSError(message) from None
            raise (FileNotFoundError if exc.code == 404 else PermissionError)(message) from None

    def list_uploads(self, bucket: str, prefix: str) -> list[Upload]:
        """Every incomplete multipart upload of a key under `prefix`."""
        uploads: list[Upload] = []
        query = {"uploads": "", "prefix": prefix}
        while True:
            root = ET.fromstring(self._request("GET", bucket, "", query))
            for u in _children(root, "Upload"):
                initiated = datetime.datetime.fromisoformat(_text(u, "Initiated").replace("Z", "+00:00"))
                uploads.append(Upload(_text(u, "Key"), _text(u, "UploadId"), initiated))
            if _text(root, "IsTruncated").lower() != "true":
                return uploads
            query = {**query, "key-marker": _text(root, "NextKeyMarker"),
                     "upload-id-marker": _text(root, "NextUploadIdMarker")}

    def abort(self, bucket: str, upload: Upload) -> None:
        """Abort an upload; nothing happens when it is gone already (completed or aborted)."""
        try:
            self._request("DELETE", bucket, upload.key, {"uploadId": upload.upload_id})
        except FileNotFoundError:
            pass
