"""A persistent cache of what is derived from a model file or this machine, so a second start skips the work.

What goes in: a GGUF's parsed config, converted tokenizer and dequantized weights (picovllm/loader/gguf_file.py),
and the compiled C kernels (picovllm/kernels/cpu/build.py). Each is an *entry*: a folder named by a key that
hashes everything the content depends on (the model file's size, modification time and leading bytes; the
kernel sources, compiler and flags; this module's FORMAT), so a changed input is a new key, never a stale hit.

    root/<kind>/<key>/          the files the builder wrote, plus
    root/<kind>/<key>/MANIFEST  each file's size and CRC-32

Where: $PICOVLLM_CACHE_DIR, else $XDG_CACHE_HOME/picovllm, else ~/.cache/picovllm. PICOVLLM_NO_CACHE=1 turns it
off (so does `--no-disk-cache` on the command line and EngineConfig.disk_cache=False for the model's entries).

Safety, the whole contract: an entry is built in a temporary folder and renamed into place, so a reader sees a
whole entry or none; every lookup checks the manifest (sizes and CRC-32s: whole files up to 64 MiB, samples of
larger ones), so a truncated or overwritten entry is removed and built again; two processes that miss at once
both build, the first rename wins and the other uses the winner's entry; a folder that cannot be written means
no cache and one warning.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
import warnings
import zlib
from typing import Callable

FORMAT = 1                 # bump when an entry's layout changes: every key changes with it
MANIFEST = "MANIFEST"
OFF_VALUES = ("", "0", "false", "no")


def default_root() -> str | None:
    """The cache folder the environment names, or None when PICOVLLM_NO_CACHE turns the cache off."""
    if os.environ.get("PICOVLLM_NO_CACHE", "").strip().lower() not in OFF_VALUES:
        return None
    if os.environ.get("PICOVLLM_CACHE_DIR"):
        return os.environ["PICOVLLM_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "picovllm")


def make_key(*parts: object) -> str:
    """A short hex digest of the parts (str, bytes or anything with a stable repr), FORMAT included."""
    h = hashlib.sha256(f"picovllm-cache-{FORMAT}".encode())
    for part in parts:
        data = part if isinstance(part, bytes) else repr(part).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:32]


def file_identity(path: str, head_bytes: int = 4 << 20) -> tuple:
    """What a file-derived key rests on: size, modification time and a hash of the first `head_bytes`."""
    st = os.stat(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(head_bytes)).hexdigest()
    return st.st_size, st.st_mtime_ns, head


class ArtifactCache:
    """Entries under `root` (see the module docstring). get_or_build is the one way in."""

    def __init__(self, root: str) -> None:
        self.root = root

    @classmethod
    def from_env(cls) -> "ArtifactCache | None":
        root = default_root()
        return cls(root) if root else None

    def get_or_build(self, kind: str, key: str, build: Callable[[str], None], source: str = "") -> str | None:
        """The folder of a verified entry; on a miss build(folder) fills a new one, which is then stored.
        `source` says what the entry was made from (a model path, a C file), for `picovllm cache`.

        None when the entry could not be stored (an unwritable folder, a full disk: one warning); the caller
        then does the work without the cache. Errors of build() other than OSError propagate.
        """
        final = os.path.join(self.root, kind, key)
        if self._verified(kind, key):
            return final
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=os.path.dirname(final))
        except OSError as e:
            _warn_unwritable(self.root, e)
            return None
        try:
            build(tmp)
            _write_manifest(tmp, source)
            self._install(tmp, final)
        except OSError as e:
            _warn_unwritable(self.root, e)
            return None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final if self._verified(kind, key) else None

    def _verified(self, kind: str, key: str) -> bool:
        """True for a whole, intact entry; a damaged one is moved aside and removed (False)."""
        folder = os.path.join(self.root, kind, key)
        if not os.path.isdir(folder):
            return False
        if _check_manifest(folder):
            return True
        try:
            self.remove(kind, key)
        except OSError:
            pass                              # another process removed it first, or a read-only cache
        return False

    def entries(self) -> list[dict]:
        """Every entry: kind, key, source, bytes, and when it was made (for `picovllm cache`)."""
        found = []
        for kind in sorted(os.listdir(self.root)) if os.path.isdir(self.root) else []:
            for key in sorted(k for k in os.listdir(os.path.join(self.root, kind)) if not k.startswith(".")):
                folder = os.path.join(self.root, kind, key)
                try:
                    with open(os.path.join(folder, MANIFEST)) as f:
                        manifest = json.load(f)
                    size = sum(entry[0] for entry in manifest["files"].values())
                    found.append({"kind": kind, "key": key, "source": manifest.get("source", ""), "bytes": size,
                                  "made": os.path.getmtime(os.path.join(folder, MANIFEST))})
                except (OSError, ValueError, KeyError, TypeError):
                    found.append({"kind": kind, "key": key, "source": "(incomplete or damaged)", "bytes": 0,
                                  "made": 0.0})
        return found

    def remove(self, kind: str, key: str) -> None:
        """Remove one entry (moved aside first, so a reader never sees it half-deleted)."""
        folder = os.path.join(self.root, kind, key)
        trash = os.path.join(self.root, kind, f".removed-{key}-{uuid.uuid4().hex[:8]}")
        os.rename(folder, trash)
        shutil.rmtree(trash, ignore_errors=True)

    @staticmethod
    def _install(tmp: str, final: str) -> None:
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):      # not another process that got there first
                raise


FULL_CHECK_BYTES = 64 << 20     # files up to this size are checked whole; larger ones by samples
SAMPLE, STRIDE = 64 << 10, 8 << 20


def _crc32_file(path: str) -> int:
    """CRC-32 of the whole file, or for a large one of a 64 KiB sample every 8 MiB plus the last 64 KiB: about
    1% of its bytes, which catches truncation and overwriting without reading a gigabyte at every start
    (a single flipped bit in a large file is the file system's to catch)."""
    size, crc = os.path.getsize(path), 0
    with open(path, "rb") as f:
        if size <= FULL_CHECK_BYTES:
            while chunk := f.read(8 << 20):
                crc = zlib.crc32(chunk, crc)
            return crc
        for offset in [*range(0, size - SAMPLE, STRIDE), size - SAMPLE]:
            f.seek(offset)
            crc = zlib.crc32(f.read(SAMPLE), crc)
    return crc


def _write_manifest(folder: str, source: str) -> None:
    files = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            files[os.path.relpath(path, folder)] = [os.path.getsize(path), _crc32_file(path)]
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"format": FORMAT, "source": source, "files": files}, f)


def _check_manifest(folder: str) -> bool:
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            return False
        for rel, (size, crc) in files.items():
            path = os.path.join(folder, rel)
            if os.path.getsize(path) != size or _crc32_file(path) != crc:
                return False
        return True
    except (OSError, ValueError, TypeError, KeyError):
        return False


# The cache folders this process has warned about. The one piece of process-wide state here, on purpose: the
# warning is about the process (it runs without a cache), and the warnings module's own once-per-place memory is
# reset whenever a library changes the warning filters, as transformers does on import.
_WARNED: set[str] = set()


def _warn_unwritable(root: str, error: OSError) -> None:
    if root in _WARNED:
        return
    _WARNED.add(root)
    warnings.warn(f"picovllm: cache folder {root!r} is not usable ({error.strerror or error}); "
                  f"running without it (PICOVLLM_CACHE_DIR moves it, PICOVLLM_NO_CACHE=1 turns it off)",
                  RuntimeWarning, stacklevel=3)
