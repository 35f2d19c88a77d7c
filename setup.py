"""Builds each Cython module ext/_c<name>.pyx as <package>._c<name>, beside its pure-Python twin
<package>._py<name> (the package that owns the pair and imports both); a failed compile still
installs a working package (the twin serves)."""
import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as e:  # no compiler, no headers: the twins take over
            print(f"mdiedge: compiled extensions not built ({e}); using pure Python", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            print(f"mdiedge: {ext.name} not built ({e}); using its pure-Python twin", file=sys.stderr)


def _owner(pyx):
    """The package of a compiled module: the one that holds its twin, _py<name>.py."""
    name = os.path.basename(pyx)[2:-4]
    found = glob.glob(os.path.join("mdiedge", "**", f"_py{name}.py"), recursive=True)
    if len(found) != 1:
        raise RuntimeError(f"{pyx}: expected one twin mdiedge/**/_py{name}.py, found {found}")
    return os.path.dirname(found[0]).replace(os.sep, ".")


def _extension(pyx):
    """ext/_cmatvec.pyx, ext/_cstep.pyx and ext/_cquant.pyx (kernels in ext/matvec.h,
    ext/step.h, ext/quant.h) run threads with OpenMP; the others not."""
    name = _owner(pyx) + "." + os.path.basename(pyx)[:-4]
    flags = ["-O3", "-Wno-psabi"]
    if name.endswith(("._cmatvec", "._cstep", "._cquant")):
        headers = sorted(glob.glob(os.path.join("ext", "*.h")))
        return Extension(name, [pyx], include_dirs=["ext"], depends=headers,
                         extra_compile_args=flags + ["-fopenmp"], extra_link_args=["-fopenmp"])
    return Extension(name, [pyx], extra_compile_args=flags)


def extensions():
    if os.environ.get("MDIEDGE_NO_EXTENSIONS", "") not in ("", "0"):
        return []
    try:
        from Cython.Build import cythonize

        sources = sorted(glob.glob(os.path.join("ext", "_c*.pyx")))
        modules = [_extension(p) for p in sources]
        return cythonize(modules, language_level=3, quiet=True,
                         build_dir=os.path.join("build", "cython"))
    except Exception as e:
        print(f"mdiedge: cannot cythonize ext/ ({e}); using pure Python", file=sys.stderr)
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
