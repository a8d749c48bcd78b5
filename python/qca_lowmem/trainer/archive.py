"""A checkpoint file's bytes: torch.save's zip archive with a SHA-256 digest of itself in the zip
comment, checked before torch.load reads anything (torch.load does not check the zip's CRCs, so
a flipped byte would otherwise load as a different state)."""

import hashlib
import io
import zipfile

import torch

# torch.save's archive ends with the zip's end-of-central-directory record (22 bytes, the last two
# the comment's length, 0). The digest of those bytes goes into the comment, which zip readers,
# torch's included, skip.
_END_RECORD = b"PK\x05\x06"
_END_RECORD_SIZE = 22
_TAG = b"qca-lowmem-sha256:"
_COMMENT_SIZE = len(_TAG) + 64


class DamagedCheckpoint(ValueError):
    """The file's bytes are not those saved."""


def with_digest(obj) -> bytes:
    """torch.save(obj) as bytes, its digest in the zip comment."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    archive = buffer.getvalue()
    if archive[-_END_RECORD_SIZE:-_END_RECORD_SIZE + 4] != _END_RECORD or archive[-2:] != b"\0\0":
        raise RuntimeError("torch.save wrote an archive that does not end with an empty zip comment")
    digest = hashlib.sha256(archive).hexdigest().encode()
    return archive[:-2] + _COMMENT_SIZE.to_bytes(2, "little") + _TAG + digest


def verified(data: bytes) -> bytes:
    """The archive torch.save wrote, once `data` is checked: against its digest, or (a file saved
    before digests) against the zip's CRCs. DamagedCheckpoint when a byte differs; ValueError
    when `data` is not a whole archive (truncated, or not a checkpoint)."""
    end = len(data) - _COMMENT_SIZE
    if data[end:end + len(_TAG)] == _TAG:
        archive = data[:end - 2] + b"\0\0"
        if data[end - 2:end] != _COMMENT_SIZE.to_bytes(2, "little") or \
                archive[-_END_RECORD_SIZE:-_END_RECORD_SIZE + 4] != _END_RECORD:
            raise DamagedCheckpoint("its zip end record is damaged")
        if hashlib.sha256(archive).hexdigest().encode() != data[end + len(_TAG):]:
            raise DamagedCheckpoint("its bytes differ from the digest recorded when it was saved")
        return archive
    if data[-_END_RECORD_SIZE:-_END_RECORD_SIZE + 4] == _END_RECORD and data[-2:] == b"\0\0":
        try:
            bad = zipfile.ZipFile(io.BytesIO(data)).testzip()
        except Exception as error:  # zipfile raises whatever damaged headers lead it to
            raise DamagedCheckpoint(f"its zip structure is damaged ({error})") from None
        if bad is not None:
            raise DamagedCheckpoint(f"its member {bad} fails the zip's CRC check")
        return data
    raise ValueError("not a whole torch.save archive")
