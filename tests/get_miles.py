"""Miles' `miles/` package, for the tests of slime's plugin contract: a real `Sample` and `http_utils`.

slime is not on PyPI (its users install it from source); Miles, slime's fork with the same plugin contract, is:
`miles-rl`. Its wheel also ships Miles' patched `sglang/` and a `megatron/core` tree, which would overwrite the
installed megatron-core's files (the suite tests the megatron trainer) and make `import sglang` succeed where no
SGLang server can run. So the wheel is not installed: this downloads it (pip, without its dependencies), checks
its sha256, and unpacks its `miles/` package alone into .vendor/miles-rl-<version>/ (ignored by git), which the
plugin tests put on their path (tests/conftest.py `MILES`). The README's test command runs it after the install;
it does nothing when the package is already there.

    python tests/get_miles.py
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.0.2"
WHEEL = f"miles_rl-{VERSION}-py3-none-any.whl"
SHA256 = "452c5c0d8b7fc3729f225e63194f16fa7bbe587b6936386c6501793fce7cf820"  # PyPI's file, 2026-11-27
TARGET = Path(__file__).resolve().parent.parent / ".vendor" / f"miles-rl-{VERSION}"
MARKER = TARGET / "SHA256"


def main() -> int:
    if (
        MARKER.is_file()
        and MARKER.read_text().strip() == SHA256
        and (TARGET / "miles" / "utils" / "types.py").is_file()
    ):
        print(f"get_miles: {TARGET} holds miles-rl {VERSION}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        download = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d", tmp]
        done = subprocess.run([*download, f"miles-rl=={VERSION}"], capture_output=True, text=True)
        wheel = Path(tmp) / WHEEL
        if done.returncode != 0 or not wheel.is_file():
            print(
                f"get_miles: pip could not download miles-rl=={VERSION}: {done.stderr.strip()[-500:]}", file=sys.stderr
            )
            return 2
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != SHA256:
            print(f"get_miles: {WHEEL} has sha256 {digest}, expected {SHA256}: not unpacked", file=sys.stderr)
            return 2
        staging = TARGET.with_name(TARGET.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.startswith("miles/")]
            for name in members:
                if ".." in Path(name).parts:
                    print(f"get_miles: {WHEEL} names {name!r} outside its package: not unpacked", file=sys.stderr)
                    return 2
            archive.extractall(staging, members)
        (staging / "SHA256").write_text(SHA256 + "\n")
        shutil.rmtree(TARGET, ignore_errors=True)
        staging.rename(TARGET)
    print(f"get_miles: miles-rl {VERSION}'s miles/ package unpacked into {TARGET} ({len(members)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
