#!/usr/bin/env python3
"""ZipMoE for AArch64 Linux, cross-compiled here and run under qemu-user.

    .venv/bin/python tools/aarch64.py setup
        as root: Debian's cross compilers and qemu-user, an arm64 Python (Debian's, unpacked into
        build/aarch64/sysroot: nothing of the host is replaced) and its packages (PyPI's aarch64 wheels)
    .venv/bin/python tools/aarch64.py build
        cross-compile libggml, ggml-cpu, libllama, ggml-zipmoe and llama-completion; lay them out as
        an installed zipmoe_py (build/aarch64/site)
    .venv/bin/python tools/aarch64.py run [--cpu CPU] -- CMD ARGS...
        CMD under qemu: python (the arm64 Python, with zipmoe_py on the aarch64 build), a program of
        the build (llama-completion) or a console script (zipmoe-verify, ...)

setup.sh --dev runs setup and build. The build is incremental (build/aarch64/cmake); the layout
(build/aarch64/site/zipmoe_py) is copied afresh from the source tree each time.

Environment: ZIPMOE_AARCH64_ARCH, the -march of ggml's CPU kernels (default armv8.2-a+dotprod+fp16, the
Cortex-A78AE of a Jetson Orin, also Neoverse N1 / Graviton2 and Cortex-A76; armv8-a for a Cortex-A72
such as the Raspberry Pi 4). ggml-zipmoe picks its own recovery path (SVE or NEON) at run time. QEMU_CPU,
the emulated CPU (qemu's default "max" has every feature, SVE with 512-bit vectors).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "build" / "aarch64"
CMAKE_DIR = ROOT / "cmake"
SYSROOT = ROOT / "sysroot"          # Debian arm64 packages unpacked: libc, libstdc++, libgomp, python3.11
SITE = ROOT / "site"                # the arm64 Python's packages and the zipmoe_py laid out on the build
PACKAGE = SITE / "zipmoe_py"
PYTHON = SYSROOT / "usr" / "bin" / "python3.11"
DEFAULT_ARCH = "armv8.2-a+dotprod+fp16"

CROSS_PACKAGES = ["gcc-aarch64-linux-gnu", "g++-aarch64-linux-gnu", "qemu-user"]
# what the arm64 Python and the build's programs load (libc6's loader, C++ and OpenMP runtimes)
ARM64_DEBS = ["libc6", "libgcc-s1", "libstdc++6", "libgomp1", "python3.11-minimal", "libpython3.11-minimal",
              "libpython3.11-stdlib", "libffi8", "zlib1g", "libexpat1", "libbz2-1.0", "liblzma5", "libssl3",
              "libcrypt1", "libuuid1", "libsqlite3-0"]
# the arm64 Python's packages: zipmoe_py's runtime dependencies (pyproject.toml, but llama-cpp-python,
# whose pure-Python bindings are copied from the host), the bindings' own, and pytest
PYTHON_PACKAGES = ["numpy~=2.2.6", "tqdm>=4.27", "pyyaml>=5.1", "typing-extensions>=4.5.0", "diskcache>=5.6.1",
                   "jinja2>=2.11.3", "pytest>=7.4"]
PLATFORMS = ["manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64"]
PROGRAMS = ["llama-completion"]
TARGETS = [*PROGRAMS, "ggml-zipmoe"]   # and, through them, llama, ggml, ggml-base, ggml-cpu


class SetupError(RuntimeError):
    pass


def missing_tools() -> list[str]:
    """What the build and the emulated runs need and this machine lacks, as Debian package names."""
    need = {"aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu", "aarch64-linux-gnu-g++": "g++-aarch64-linux-gnu",
            "qemu-aarch64": "qemu-user"}
    return [pkg for tool, pkg in need.items() if shutil.which(tool) is None]


def check_ready() -> None:
    """Raises SetupError naming what is missing for `run`."""
    missing = missing_tools()
    if missing:
        raise SetupError(f"{', '.join(missing)} missing: run `bash tools/setup.sh --dev` as root "
                         f"(or apt-get install {' '.join(missing)})")
    if not PYTHON.exists() or not (SITE / "numpy").is_dir():
        raise SetupError(f"the arm64 Python is not set up in {ROOT}: run `.venv/bin/python tools/aarch64.py setup` as root")
    if not (PACKAGE / "lib" / "libggml-zipmoe.so").exists():
        raise SetupError(f"no aarch64 build in {PACKAGE}: run `.venv/bin/python tools/aarch64.py build`")


def _run(cmd: list, **kwargs) -> None:
    proc = subprocess.run([str(c) for c in cmd], **kwargs)
    if proc.returncode != 0:
        raise SetupError(f"`{' '.join(str(c) for c in cmd)}` failed with status {proc.returncode}")


def setup() -> None:
    if missing_tools() or not PYTHON.exists():
        if os.geteuid() != 0:
            raise SetupError(f"installing Debian packages needs root: apt-get install {' '.join(CROSS_PACKAGES)}, "
                             "and the arm64 architecture (dpkg --add-architecture arm64)")
        arches = subprocess.run(["dpkg", "--print-foreign-architectures"], capture_output=True, text=True).stdout
        if "arm64" not in arches.split():
            _run(["dpkg", "--add-architecture", "arm64"])
        _run(["apt-get", "update", "-qq"])
        _run(["apt-get", "install", "-y", "-qq", *CROSS_PACKAGES], stdout=subprocess.DEVNULL)
        debs = ROOT / "debs"
        shutil.rmtree(debs, ignore_errors=True)
        debs.mkdir(parents=True)
        _run(["apt-get", "download", "-qq", *(f"{name}:arm64" for name in ARM64_DEBS)], cwd=debs,
             stderr=subprocess.DEVNULL)  # its "unsandboxed download as root" note
        shutil.rmtree(SYSROOT, ignore_errors=True)
        for deb in sorted(debs.glob("*.deb")):
            _run(["dpkg-deb", "-x", deb, SYSROOT])
        shutil.rmtree(debs)
    if not (SITE / "numpy").is_dir():
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        _run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", SITE,
              *platforms, "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
              *PYTHON_PACKAGES])
    print(f"aarch64: qemu-user, the cross compilers and an arm64 Python in {ROOT}")


def build(arch: str) -> None:
    if missing_tools():
        raise SetupError(f"{', '.join(missing_tools())} missing: run `.venv/bin/python tools/aarch64.py setup` as root")
    configured = CMAKE_DIR / "CMakeCache.txt"
    if configured.exists() and f"GGML_CPU_ARM_ARCH:STRING={arch}\n" not in configured.read_text():
        shutil.rmtree(CMAKE_DIR)  # another -march: every kernel is rebuilt anyway
    if not configured.exists():
        # install RPATHs in the build tree ($ORIGIN, $ORIGIN/../lib), so the laid-out copies find each other
        _run(["cmake", "-S", REPO, "-B", CMAKE_DIR, "-G", "Ninja" if shutil.which("ninja") else "Unix Makefiles",
              f"-DCMAKE_TOOLCHAIN_FILE={REPO / 'tools' / 'aarch64-linux-gnu.cmake'}", "-DCMAKE_BUILD_TYPE=Release",
              "-DGGML_NATIVE=OFF", f"-DGGML_CPU_ARM_ARCH={arch}", "-DZIPMOE_CUDA=OFF",
              "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", f"-DPython3_EXECUTABLE={sys.executable}"],
             stdout=subprocess.DEVNULL)
    _run(["cmake", "--build", CMAKE_DIR, "-j", str(os.cpu_count() or 2), "--target", *TARGETS],
         stdout=subprocess.DEVNULL)
    lay_out()
    print(f"aarch64 ({arch}): {PACKAGE}")


def lay_out() -> None:
    """build/aarch64/site/zipmoe_py: this source tree's zipmoe_py with the aarch64 libraries and
    llama-completion, laid out as an install is (lib/, bin/), beside the host's pure-Python llama_cpp
    bindings and vendored llama.cpp files (gguf-py, vocab GGUFs)."""
    import importlib.util

    import zipmoe_py._paths as host  # the installed package (.venv): its vendored llama.cpp files

    shutil.rmtree(PACKAGE, ignore_errors=True)
    for stale in PYTHON.parent.iterdir():
        if stale.name != PYTHON.name:
            stale.unlink()
    shutil.copytree(REPO / "zipmoe_py", PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    (PACKAGE / "lib").mkdir()
    (PACKAGE / "bin").mkdir()
    for lib in [*(CMAKE_DIR / "bin").glob("*.so"), CMAKE_DIR / "ggml-zipmoe" / "libggml-zipmoe.so",
                CMAKE_DIR / "tools" / "completion" / "libllama-completion-impl.so"]:
        shutil.copy2(lib, PACKAGE / "lib" / lib.name)
    for program in PROGRAMS:
        shutil.copy2(CMAKE_DIR / "tools" / "completion" / program, PACKAGE / "bin" / f"{program}.aarch64")
        write_wrapper(PACKAGE / "bin" / program, [PACKAGE / "bin" / f"{program}.aarch64"])
    (PACKAGE / "_llama_cpp").symlink_to(host.LLAMA_CPP_DIR)
    # the console scripts (pyproject.toml) beside the arm64 Python, as a venv has them beside its own
    with open(REPO / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    for name, entry in scripts.items():
        module, function = entry.split(":")
        if module.endswith(".fork_programs") and name not in PROGRAMS:
            continue  # a llama.cpp program this build does not make
        code = f"import sys; sys.argv[0] = {name!r}; from {module} import {function}; sys.exit({function}())"
        write_wrapper(PYTHON.parent / name, [PYTHON, "-P", "-c", code])  # -P: not the current folder first
    # the host's pure-Python llama_cpp (LLAMA_BUILD=OFF: no library of its own), found without importing it
    bindings = Path(importlib.util.find_spec("llama_cpp").origin).parent
    shutil.rmtree(SITE / "llama_cpp", ignore_errors=True)
    shutil.copytree(bindings, SITE / "llama_cpp", ignore=shutil.ignore_patterns("__pycache__", "*.so"))


def write_wrapper(path: Path, argv: list) -> None:
    """A host shell script that runs argv under qemu-aarch64 with its arguments: an emulated process
    cannot exec an AArch64 program itself (no binfmt_misc here), but it can exec this."""
    quoted = " ".join(shlex.quote(str(a)) for a in argv)
    path.write_text(f"#!/bin/sh\nexec qemu-aarch64 -L {shlex.quote(str(SYSROOT))} {quoted} \"$@\"\n")
    path.chmod(0o755)


def command(args: list[str], cpu: str | None = None) -> tuple[list[str], dict]:
    """(argv, environment) running args under qemu-aarch64: `python ...` is the arm64 Python with
    build/aarch64/site on its path; a name in zipmoe_py/bin is that program of the build."""
    check_ready()
    env = {**os.environ, "PYTHONPATH": str(SITE), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONHOME", None)
    env.pop("LLAMA_CPP_LIB_PATH", None)  # zipmoe_py sets it to its own (aarch64) lib/
    if cpu:
        env["QEMU_CPU"] = cpu
    if args[0] in ("python", "python3"):
        return ["qemu-aarch64", "-L", str(SYSROOT), str(PYTHON), *args[1:]], env
    for folder in (PACKAGE / "bin", PYTHON.parent):  # the build's programs, the console scripts: wrappers
        if (folder / args[0]).is_file() and "/" not in args[0]:
            return [str(folder / args[0]), *args[1:]], env
    return ["qemu-aarch64", "-L", str(SYSROOT), *args], env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/aarch64.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("setup", help="install the cross compilers, qemu-user and an arm64 Python (root)")
    sub.add_parser("build", help="cross-compile the fork and lay it out in build/aarch64/site")
    run = sub.add_parser("run", help="run a program of the build, or python, under qemu")
    run.add_argument("--cpu", help="the emulated CPU (qemu-aarch64 -cpu help lists them; default: max)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="python ARGS... or llama-completion ARGS...")
    args = parser.parse_args(argv)
    try:
        if args.step == "setup":
            setup()
        elif args.step == "build":
            build(os.environ.get("ZIPMOE_AARCH64_ARCH") or DEFAULT_ARCH)
        else:
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                parser.error("run needs a command: python ARGS... or llama-completion ARGS...")
            argv_, env = command(cmd, args.cpu)
            return subprocess.run(argv_, env=env).returncode
    except SetupError as e:
        print(f"aarch64: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
