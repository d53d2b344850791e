"""Build of trainscout's one optional C extension, `trainscout.fingerprint._native` (the CPU fingerprint at
memory speed; spec.md in src/trainscout/fingerprint/). Everything else about the package (name, version,
dependencies, packages) is in pyproject.toml.

The extension is optional: without a C compiler or Python's headers, or with TRAINSCOUT_NO_NATIVE=1 in the
environment, the build prints a warning and the package installs without it; `trainscout.fingerprint.cpu`
then computes the same values with numpy, only slower. `pip install -e .` builds it in place (next to
_native.c), so an editable install imports it too.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that optimises the auto-vectorised loop and never fails the install over the extension."""

    def build_extension(self, ext):
        if self.compiler.compiler_type == "unix":
            # -O3: gcc only vectorises loops like the fingerprint's (trip count unknown) at -O3, and some
            # Pythons' CFLAGS say -O2; it comes after them, so it wins.
            ext.extra_compile_args = [*ext.extra_compile_args, "-O3"]
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - any failure only costs speed: the numpy path stays
            if not ext.optional:
                raise
            self.warn(f"building optional extension {ext.name} failed ({exc}); the numpy path will be used")


def extensions() -> list[Extension]:
    if os.environ.get("TRAINSCOUT_NO_NATIVE", "").strip() not in ("", "0"):
        print("TRAINSCOUT_NO_NATIVE is set: not building trainscout.fingerprint._native", file=sys.stderr)
        return []
    return [
        Extension(
            "trainscout.fingerprint._native",
            sources=["src/trainscout/fingerprint/_native.c"],
            optional=True,
        )
    ]


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
