"""Check every staged file against the manifest, and make what the upload wrote durable.

Runs on the host, in the staging directory, under any ``python3`` from 3.5 on (stdlib only), sent as
``python3 -I -c <this file> .kdeploy/manifest.sha256``. Durable: files with one link (not shared with
``current``) and the directories, synced on a thread per core beside the hashing. hashlib is OpenSSL's
SHA-256 (SHA extensions where the CPU has them: 0.16 s for 200 MB where coreutils' sha256sum took 0.68 s).
Exits non-zero with one line naming the files that differ.
"""

import hashlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor


def digest(path):
    h = hashlib.sha256()
    try:
        with open(path, "rb", buffering=0) as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return None
    return h.hexdigest()


def size(entry):
    try:
        return -os.path.getsize(entry[0])
    except OSError:
        return 0


def sync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(path):
    """``(path, sha256)`` of each line of a ``sha256sum`` manifest, the largest file first."""
    expected = []
    with open(path) as f:
        for line in f:
            sha, _, name = line.rstrip("\n").partition("  ")
            expected.append((name, sha))
    expected.sort(key=size)
    return expected


def written(top_dir):
    """What must be synced: every directory, and every file with one link."""
    durable = []
    for top, _dirs, files in os.walk(top_dir):
        durable.append(top)
        durable += [p for p in (os.path.join(top, n) for n in files) if os.lstat(p).st_nlink == 1]
    return durable


def main(argv):
    expected = read_manifest(argv[1])
    with ThreadPoolExecutor(max(2, min(16, os.cpu_count() or 1))) as pool:
        synced = [pool.submit(sync, p) for p in written(".")]
        bad = [path for (path, sha), got in zip(expected, pool.map(digest, [p for p, _ in expected])) if got != sha]
        for s in synced:
            s.result()
    if bad:
        sys.exit("%d staged file(s) differ from the manifest (sha256): %s" % (len(bad), " ".join(sorted(bad)[:5])))


if __name__ == "__main__":
    main(sys.argv)
