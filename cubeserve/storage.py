"""Object-store I/O for the pipeline steps: directories of files (checkpoints, Triton model
repositories) and small text objects, on S3 or on a local filesystem, through one small API.

URIs: `s3://bucket/prefix`, `file:///absolute/path`, or a plain local path. An S3 "directory"
is a key prefix: every function here treats `s3://b/m/1` and `s3://b/m/1/` alike, as the
objects under `m/1/`, so a sibling `m/10/` is never part of `m/1`. KServe's storage initializer
is different: it lists with the storageUri's path as a bare prefix and strips it from every key,
so `storageUri: s3://b/m/1` also downloads `m/10/...` (into `/mnt/models/0/...`). A storageUri
for a version directory must therefore end with a slash: `as_dir(join(base, "1"))` gives it.

S3 access uses boto3 (what KServe's storage initializer uses) with credentials and endpoint only
from the environment variables that KServe's S3 Secret sets for the storage initializer:
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN when set), AWS_ENDPOINT_URL
(unset: AWS itself), AWS_DEFAULT_REGION (default us-east-1), S3_VERIFY_SSL ("0" or "false" turns
TLS verification off, as in kserve-storage; AWS_CA_BUNDLE names a CA file) and
S3_USER_VIRTUAL_BUCKET ("true": virtual-hosted bucket addressing, as in kserve-storage).

Every failure is a StorageError (a ValueError) whose message starts with the URI and says what
to fix: missing or wrong credentials, an endpoint that does not answer, a missing bucket, an
unsupported scheme, nothing to download. Free of torch (and boto3 is imported only for s3://).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

SUPPORTED = "s3://bucket/prefix, file:///absolute/path or a local path"
CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
DEFAULT_REGION = "us-east-1"


class StorageError(ValueError):
    """An object-store operation failed; the message names the URI and the cause."""


class PreconditionFailed(StorageError):
    """A conditional write lost: the object exists already (create) or changed since it was
    read (replace)."""


@dataclass(frozen=True)
class _S3:
    bucket: str
    key: str  # without the leading slash; "" is the bucket's root

    @property
    def dir_prefix(self) -> str:
        """The key prefix of the "directory" at `key`: "m/1" and "m/1/" both give "m/1/"."""
        return self.key.rstrip("/") + "/" if self.key.strip("/") else ""


def _parse(uri: str | os.PathLike) -> _S3 | Path:
    text = os.fspath(uri)
    if not text:
        raise StorageError(f"an empty URI; use {SUPPORTED}")
    scheme, sep, rest = text.partition("://")
    if not sep:
        return Path(text)
    scheme = scheme.lower()
    if scheme == "s3":
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise StorageError(f"{text}: no bucket name; use s3://bucket/prefix")
        return _S3(bucket, key)
    if scheme == "file":
        host, _, path = rest.partition("/")
        if host not in ("", "localhost"):
            raise StorageError(f"{text}: a file:// URI needs an absolute path (file:///absolute/path), "
                               f"not the host {host!r}")
        return Path("/" + unquote(path))
    raise StorageError(f"{text}: the URI scheme {scheme}:// is not supported; use {SUPPORTED}")


# -- URIs ---------------------------------------------------------------------------------------

def join(uri: str, *parts: str) -> str:
    """`uri` with path segments appended, one slash between each: join("s3://b/m", "7") is
    "s3://b/m/7". Parts may hold slashes; "." and ".." are refused. No trailing slash is added
    (see as_dir)."""
    _parse(uri)  # refuse an unsupported scheme here, not at the first request
    segments = []
    for part in parts:
        for segment in str(part).split("/"):
            if segment in (".", ".."):
                raise StorageError(f"{uri}: refusing to join the path segment {segment!r} ({part!r})")
            if segment:
                segments.append(segment)
    if not segments:
        return uri
    return uri.rstrip("/") + "/" + "/".join(segments)


def as_dir(uri: str) -> str:
    """`uri` with exactly one trailing slash: the form a KServe storageUri of a directory needs
    (see the module docstring)."""
    _parse(uri)
    return uri.rstrip("/") + "/"


# -- S3 client and errors -----------------------------------------------------------------------

def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL") or f"AWS S3 in {os.environ.get('AWS_DEFAULT_REGION') or DEFAULT_REGION}"


# What a client is made from (AWS_CA_BUNDLE: botocore reads it itself when the client is made).
_ENVIRONMENT = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                "AWS_DEFAULT_REGION", "S3_VERIFY_SSL", "S3_USER_VIRTUAL_BUCKET", "AWS_CA_BUNDLE")


def _client(uri: str):
    """A boto3 S3 client configured from the environment alone (one per set of values)."""
    missing = [name for name in CREDENTIAL_VARIABLES if not os.environ.get(name)]
    if missing:
        raise StorageError(f"{uri}: no S3 credentials: set {' and '.join(missing)} (with AWS_ENDPOINT_URL for "
                           f"a store other than AWS), as KServe's S3 Secret does")
    return _cached_client(tuple(os.environ.get(name) or "" for name in _ENVIRONMENT))


@functools.lru_cache(maxsize=8)
def _cached_client(values: tuple[str, ...]):
    import boto3
    from botocore.config import Config

    env = dict(zip(_ENVIRONMENT, values))
    verify = env["S3_VERIFY_SSL"]
    s3_options = {"addressing_style": "virtual"} if env["S3_USER_VIRTUAL_BUCKET"].lower() == "true" else {}
    session = boto3.session.Session(aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                                    aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                                    aws_session_token=env["AWS_SESSION_TOKEN"] or None,
                                    region_name=env["AWS_DEFAULT_REGION"] or DEFAULT_REGION)
    return session.client(
        "s3", endpoint_url=env["AWS_ENDPOINT_URL"] or None,
        verify=None if not verify else verify.lower() not in ("0", "false"),
        config=Config(connect_timeout=10, read_timeout=60, retries={"max_attempts": 3, "mode": "standard"},
                      s3=s3_options))


def _client_error_message(uri: str, location: _S3, action: str, error) -> str:
    code = error.response.get("Error", {}).get("Code", "")
    message = error.response.get("Error", {}).get("Message", "") or str(error)
    key_id = os.environ.get("AWS_ACCESS_KEY_ID", "")
    if code == "SignatureDoesNotMatch":
        return (f"{uri}: the S3 endpoint {_endpoint()} refused the credentials: the request signature does not "
                f"match (SignatureDoesNotMatch); AWS_SECRET_ACCESS_KEY is wrong for AWS_ACCESS_KEY_ID {key_id!r}")
    if code == "InvalidAccessKeyId":
        return (f"{uri}: the S3 endpoint {_endpoint()} does not know the access key AWS_ACCESS_KEY_ID "
                f"{key_id!r} (InvalidAccessKeyId); check AWS_ACCESS_KEY_ID and AWS_ENDPOINT_URL")
    if code in ("AccessDenied", "403", "Forbidden"):
        return (f"{uri}: access denied by {_endpoint()} ({code}): the credentials of AWS_ACCESS_KEY_ID {key_id!r} "
                f"may not {action} bucket {location.bucket!r}")
    if code == "NoSuchBucket":
        return f"{uri}: no such bucket {location.bucket!r} at {_endpoint()} (NoSuchBucket); create it or fix the URI"
    return f"{uri}: {action} failed at {_endpoint()}: {code or 'error'}: {message}"


@contextmanager
def _s3_errors(uri: str, location: _S3, action: str):
    """botocore's exceptions -> StorageError with the URI and a cause a user can act on."""
    from boto3.exceptions import S3TransferFailedError, S3UploadFailedError
    from botocore import exceptions as bx

    try:
        yield
    except StorageError:
        raise
    except bx.ClientError as exc:
        raise StorageError(_client_error_message(uri, location, action, exc)) from exc
    except (S3UploadFailedError, S3TransferFailedError) as exc:  # boto3 wraps the ClientError
        cause = exc.__context__
        if isinstance(cause, bx.ClientError):
            raise StorageError(_client_error_message(uri, location, action, cause)) from exc
        raise StorageError(f"{uri}: {action} failed: {exc}") from exc
    except bx.SSLError as exc:
        raise StorageError(f"{uri}: TLS with the S3 endpoint {_endpoint()} failed: {exc}; give its CA in "
                           f"AWS_CA_BUNDLE, or set S3_VERIFY_SSL=0 to skip verification") from exc
    except (bx.NoCredentialsError, bx.PartialCredentialsError) as exc:
        raise StorageError(f"{uri}: no S3 credentials ({exc}): set {' and '.join(CREDENTIAL_VARIABLES)}") from exc
    except (bx.ConnectionError, bx.HTTPClientError) as exc:
        raise StorageError(f"{uri}: cannot reach the S3 endpoint {_endpoint()} (AWS_ENDPOINT_URL): {exc}") from exc
    except bx.BotoCoreError as exc:
        raise StorageError(f"{uri}: {action} failed at {_endpoint()}: {exc}") from exc


def _list(client, location: _S3, prefix: str, delimiter: str = "") -> tuple[list[dict], list[str]]:
    """(objects, common prefixes) under `prefix`, every page."""
    objects, prefixes = [], []
    paginator = client.get_paginator("list_objects_v2")
    kwargs = {"Bucket": location.bucket, "Prefix": prefix, **({"Delimiter": delimiter} if delimiter else {})}
    for page in paginator.paginate(**kwargs):
        objects += page.get("Contents", [])
        prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
    return objects, prefixes


def _check_bucket(client, location: _S3) -> None:
    """One cheap GET, so that credentials, endpoint and bucket fail before any transfer, with
    S3's error code (a HEAD's error response carries none)."""
    client.list_objects_v2(Bucket=location.bucket, MaxKeys=1)


# -- local files --------------------------------------------------------------------------------

def _local_files(root: Path) -> list[str]:
    """Every file under `root` (hidden ones too; symlinks followed) as sorted relative POSIX
    paths; anything that is neither a file nor a directory is refused by name."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        for name in filenames:  # a broken link, a socket or a device is listed here too
            path = Path(dirpath, name)
            if not path.is_file():
                raise StorageError(f"{path}: not a regular file (a broken link, a socket or a device); "
                                   f"refusing to skip it")
            files.append(path.relative_to(root).as_posix())
    return sorted(files)


def _safe_relative(uri: str, rel: str) -> str:
    if not rel or any(part in ("", ".", "..") for part in rel.split("/")):
        raise StorageError(f"{uri}: refusing the object {rel!r}: its key does not map to a file below the "
                           f"target directory")
    return rel


# -- the API ------------------------------------------------------------------------------------

def upload_dir(local_dir: str | Path, uri: str) -> list[str]:
    """Copy every file under `local_dir` to the directory `uri` (files already there are
    overwritten, others kept); returns the relative paths copied. Nothing is skipped: an
    empty directory, or an entry that is not a regular file, is refused."""
    source = Path(local_dir)
    location = _parse(uri)
    if not source.is_dir():
        raise StorageError(f"{source}: not a directory; nothing to upload to {uri}")
    files = _local_files(source)
    if not files:
        raise StorageError(f"{source}: holds no files; nothing to upload to {uri}")
    if isinstance(location, Path):
        for rel in files:
            target = location / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / rel, target)
        return files
    client = _client(uri)
    with _s3_errors(uri, location, "write to"):
        _check_bucket(client, location)
        for rel in files:
            client.upload_file(str(source / rel), location.bucket, location.dir_prefix + rel)
    return files


def download_dir(uri: str, local_dir: str | Path) -> list[str]:
    """Copy every object under the directory `uri` into `local_dir` (created if needed); returns
    the relative paths copied. Refuses a prefix with no objects (a typo, a version that was
    never uploaded) with an error naming the URI."""
    target = Path(local_dir)
    location = _parse(uri)
    if isinstance(location, Path):
        files = _local_files(location) if location.is_dir() else []
        if not files:
            raise StorageError(f"{uri}: nothing to download: "
                               f"{'an empty directory' if location.is_dir() else 'no such directory'}")
        for rel in files:
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(location / rel, target / rel)
        return files
    client = _client(uri)
    prefix = location.dir_prefix
    with _s3_errors(uri, location, "read"):
        objects, _ = _list(client, location, prefix)
        keys = [o["Key"] for o in objects]
        files = [_safe_relative(uri, k[len(prefix):]) for k in keys if not k.endswith("/")]
        if not files:
            raise StorageError(f"{uri}: nothing to download: no objects under s3://{location.bucket}/{prefix} "
                               f"at {_endpoint()}")
        for key in keys:  # a key ending in "/" is a directory marker: the directory, no file
            rel = key[len(prefix):]
            if key.endswith("/"):
                if rel.strip("/"):
                    (target / _safe_relative(uri, rel.rstrip("/"))).mkdir(parents=True, exist_ok=True)
                continue
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            client.download_file(location.bucket, key, str(target / rel))
    return sorted(files)


def read_text(uri: str) -> str | None:
    """The UTF-8 text of one object, or None when it does not exist (a missing bucket is an
    error, not an absent object)."""
    data = read_bytes(uri)
    return None if data is None else data.decode("utf-8")


def read_bytes(uri: str) -> bytes | None:
    """The bytes of one object, or None when it does not exist (as read_text)."""
    location = _parse(uri)
    if isinstance(location, Path):
        try:
            return location.read_bytes()
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise StorageError(f"{uri}: a directory, not a file") from None
    if not location.key or location.key.endswith("/"):
        raise StorageError(f"{uri}: names a directory (a prefix), not an object")
    client = _client(uri)
    with _s3_errors(uri, location, "read"):
        try:
            body = client.get_object(Bucket=location.bucket, Key=location.key)["Body"]
        except client.exceptions.NoSuchKey:
            return None
        return body.read()


def write_bytes(uri: str, data: bytes, content_type: str = "application/octet-stream") -> None:
    """Write one object (a local file is replaced atomically: written beside it, then renamed)."""
    location = _parse(uri)
    if isinstance(location, Path):
        location.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=location.parent, prefix=f".{location.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, location)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return
    if not location.key or location.key.endswith("/"):
        raise StorageError(f"{uri}: names a directory (a prefix), not an object")
    client = _client(uri)
    with _s3_errors(uri, location, "write to"):
        client.put_object(Bucket=location.bucket, Key=location.key, Body=data, ContentType=content_type)


# -- conditional writes: what lets runs that overlap agree (cubeserve.pipeline.leases) -------------
# S3's conditional writes (PutObject with If-None-Match: * or If-Match: <ETag>; AWS S3 since 2024,
# MinIO): the store refuses with 412 PreconditionFailed (409 ConditionalRequestConflict while
# another conditional write to the key is in flight). A store that ignores the headers accepts
# every write: `honours_conditional_writes` finds out. Local paths do the same under a lock file.

def read_versioned(uri: str) -> tuple[str, str] | None:
    """(text, ETag) of one object, None when it does not exist; pass the ETag to write_if."""
    location = _parse(uri)
    if isinstance(location, Path):
        with _local_lock(location):
            text = read_text(uri)
        return None if text is None else (text, _local_etag(text.encode("utf-8")))
    client = _client(uri)
    with _s3_errors(uri, location, "read"):
        try:
            reply = client.get_object(Bucket=location.bucket, Key=location.key)
        except client.exceptions.NoSuchKey:
            return None
        return reply["Body"].read().decode("utf-8"), reply["ETag"]


def write_if(uri: str, text: str, etag: str | None) -> str:
    """Write `text` only if the object does not exist (etag None) or still has `etag` (what
    read_versioned gave); returns the new ETag. PreconditionFailed when another writer won."""
    data = text.encode("utf-8")
    location = _parse(uri)
    if isinstance(location, Path):
        with _local_lock(location):
            current = location.read_bytes() if location.exists() else None
            if (etag is None and current is not None) or (
                    etag is not None and (current is None or _local_etag(current) != etag)):
                raise PreconditionFailed(f"{uri}: " + ("exists already" if etag is None else "changed since it was read"))
            write_bytes(uri, data)
        return _local_etag(data)
    from botocore import exceptions as bx

    client = _client(uri)
    condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
    with _s3_errors(uri, location, "write to"):  # (it passes a StorageError on as it is)
        try:
            return client.put_object(Bucket=location.bucket, Key=location.key, Body=data,
                                     ContentType="application/json", **condition)["ETag"]
        except bx.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                what = "exists already" if etag is None else "changed since it was read"
                raise PreconditionFailed(f"{uri}: {what} ({code or status})") from exc
            raise


def honours_conditional_writes(uri: str) -> bool:
    """Whether the store under the directory `uri` refuses a second create of one object (a
    probe object, removed afterwards). rclone's `serve s3` does not (rclone issue #8566)."""
    import uuid

    probe = join(uri, f".conditional-write-probe-{uuid.uuid4().hex}")
    write_if(probe, "probe", None)
    try:
        write_if(probe, "probe", None)
        return False
    except PreconditionFailed:
        return True
    finally:
        delete(probe)


def delete(uri: str) -> None:
    """Remove one object (no error when it is absent)."""
    location = _parse(uri)
    if isinstance(location, Path):
        location.unlink(missing_ok=True)
        return
    client = _client(uri)
    with _s3_errors(uri, location, "delete from"):
        client.delete_object(Bucket=location.bucket, Key=location.key)


def _local_etag(data: bytes) -> str:
    import hashlib

    return '"' + hashlib.md5(data).hexdigest() + '"'  # noqa: S324 - S3's ETag of a plain PUT


@contextmanager
def _local_lock(path: Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"), "text/plain; charset=utf-8")


def upload_path(local: str | Path, uri: str) -> None:
    """A file to the object `uri`, or a folder to the directory `uri` (what KFP's launcher does
    with an output artifact)."""
    local = Path(local)
    if local.is_dir():
        upload_dir(local, uri)
    else:
        write_bytes(uri, local.read_bytes())


def list_dirs(uri: str) -> list[str]:
    """The names of the immediate "sub-directories" of the directory `uri`, sorted as strings
    (sort version numbers with key=int); [] when there are none or the prefix does not exist."""
    location = _parse(uri)
    if isinstance(location, Path):
        return sorted(p.name for p in location.iterdir() if p.is_dir()) if location.is_dir() else []
    client = _client(uri)
    prefix = location.dir_prefix
    with _s3_errors(uri, location, "list"):
        _, prefixes = _list(client, location, prefix, delimiter="/")
    return sorted(p[len(prefix):].rstrip("/") for p in prefixes)


def local_path(uri: str) -> Path | None:
    """The local path a URI names (a plain path or file://), None for an object-store URI."""
    location = _parse(uri)
    return location if isinstance(location, Path) else None


def exists(uri: str) -> bool:
    """Whether `uri` is an object, or a directory holding at least one object (the bucket's root:
    whether the bucket exists). A missing bucket under a longer URI is an error, not False, so
    that a misspelt bucket never reads as "not there yet"."""
    location = _parse(uri)
    if isinstance(location, Path):
        return location.exists()
    client = _client(uri)
    with _s3_errors(uri, location, "read"):
        if not location.key.strip("/"):
            try:
                _check_bucket(client, location)
                return True
            except client.exceptions.NoSuchBucket:
                return False
        if not location.key.endswith("/"):
            page = client.list_objects_v2(Bucket=location.bucket, Prefix=location.key, MaxKeys=1)
            if any(o["Key"] == location.key for o in page.get("Contents", [])):
                return True
        page = client.list_objects_v2(Bucket=location.bucket, Prefix=location.dir_prefix, MaxKeys=1)
        return bool(page.get("Contents"))
