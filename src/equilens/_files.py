"""Output files written atomically: a run that is interrupted leaves the previous file or
none, never a truncated one."""

import contextlib
import os
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yields a temporary path beside `path` (same folder and extension, so writers that
    choose a format by the extension still do); when the block finishes, the file written
    there replaces `path` in one step (`os.replace`), with the permissions a new file would
    have. If the block raises, the temporary file is removed and `path` is untouched."""
    target = os.path.abspath(os.fspath(path))
    base, ext = os.path.splitext(os.path.basename(target))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=ext, dir=os.path.dirname(target))
    os.close(fd)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
