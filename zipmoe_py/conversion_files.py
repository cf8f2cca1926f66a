"""What a conversion writes beside its output: temporary names, the output's lock (OUT.lock), the work
folder of a checkpoint's intermediate BF16 GGUF, and the removal of what killed conversions leave behind."""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import tempfile
from pathlib import Path

from .errors import ZipMoEError

def temporary_name(path: Path, suffix: str = "") -> Path:
    """PATH.<pid>.<random><suffix> beside path: the same filesystem (so that os.replace is atomic)
    and a name no other process writes. remove_stale_temporaries knows the pattern."""
    return path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}")


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_temporaries(path: Path) -> None:
    """Remove path's temporary files (temporary_name, and format.repack's .partial of one) that
    a killed conversion left. Called with path's lock held, so no other zipmoe-convert is writing
    them; the pid in the name must be dead too, for a caller of the library that takes no lock."""
    pattern = re.compile(re.escape(path.name) + r"\.(\d+)\.[0-9a-f]{8}(\.partial)?")
    for leftover in path.parent.iterdir():
        found = pattern.fullmatch(leftover.name)
        if found and leftover.is_file() and not process_alive(int(found[1])):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


@contextlib.contextmanager
def output_lock(path: Path):
    """Hold an exclusive flock on PATH.lock while path is written; refuse (ZipMoEError naming the
    holder's pid) if another zipmoe-convert holds it. An flock vanishes with its process, so a
    killed conversion's lock file blocks no one; the file itself is removed on the way out."""
    lock_path = path.with_name(path.name + ".lock")
    fd, held = -1, False
    try:
        while not held:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip()
                raise ZipMoEError(f"{path} is being written by another zipmoe-convert"
                                  + (f" (pid {holder})" if holder.isdigit() else "")
                                  + f"; wait for it to finish, or write elsewhere (its lock: {lock_path})") from None
            # the previous holder may have removed the file between our open and our flock: then the lock
            # we hold guards nothing, and a third process may already hold a new one; start over
            try:
                held = os.path.samestat(os.fstat(fd), os.stat(lock_path))
            except FileNotFoundError:
                held = False
            if not held:
                os.close(fd)
                fd = -1
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        remove_stale_temporaries(path)
        yield
    finally:
        if held:  # removed while still held, so that whoever opens it next sees it gone (the check above)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)
        if fd >= 0:
            os.close(fd)


WORK_FOLDER_PREFIX = ".zipmoe-"


class Interrupted(BaseException):
    """SIGINT or SIGTERM during a conversion: unwinds like KeyboardInterrupt, so that every partial
    file is removed on the way out."""


# Held interrupts are a flag, not a signal mask: a mask is per thread, and while the main thread blocks
# SIGTERM the kernel hands it to another thread (numpy's, the converter's readers), whose C handler
# has Python run on_interrupt in the main thread at once. on_interrupt itself must therefore wait.
_held = 0
_pending: int | None = None


def on_interrupt(signum, frame) -> None:
    """The conversion's SIGINT and SIGTERM handler: raises Interrupted, or, while interrupts are
    held, keeps the signal for release_interrupts to raise."""
    global _pending
    if _held:
        _pending = signum
        return
    raise Interrupted(signal.Signals(signum).name)


def hold_interrupts() -> None:
    """Hold SIGINT and SIGTERM around the creation of something the interrupt's cleanup must know (a
    folder, a child process), or around that cleanup: one that lands meanwhile raises at the release."""
    global _held
    _held += 1


def release_interrupts() -> None:
    global _held, _pending
    _held -= 1
    if not _held and _pending is not None:
        signum, _pending = _pending, None
        raise Interrupted(signal.Signals(signum).name)


@contextlib.contextmanager
def work_folder(parent: Path):
    """A hidden folder .zipmoe-<pid>-<random> in parent for the intermediate BF16 GGUF (beside
    the output: the same filesystem, whose free space the user chose), removed on the way out.
    Its owner.lock is flocked for the folder's life, so a later conversion tells a killed
    process's folder (lock free) from a running one's (remove_stale_work_folders)."""
    folder, fd = None, None
    try:
        hold_interrupts()  # an interrupt between mkdtemp's mkdir and `folder =` would leave it
        try:
            folder = Path(tempfile.mkdtemp(dir=parent, prefix=f"{WORK_FOLDER_PREFIX}{os.getpid()}-"))
            # locked under another name, then renamed: owner.lock never exists unlocked while we live
            unlocked = folder / "owner.lock.new"
            fd = os.open(unlocked, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.rename(unlocked, folder / "owner.lock")
        finally:
            release_interrupts()  # one held meanwhile raises here, with the folder known
        yield folder
    finally:
        hold_interrupts()  # a second interrupt must not cut the removal short
        try:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            if fd is not None:
                os.close(fd)
        finally:
            release_interrupts()


def remove_stale_locks(parent: Path) -> None:
    """Remove the OUT.lock files in parent of conversions that were killed, with OUT's temporaries: ours
    hold nothing but the writer's pid, and a lock that no process holds, whose pid is dead, guards nothing."""
    for lock_path in parent.glob("*.lock"):
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, a link, or someone else's
        try:
            holder = os.read(fd, 32)
            if not re.fullmatch(rb"\d+\n", holder) or process_alive(int(holder)):
                continue  # not one of ours, or its conversion may be running
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # held now, so no conversion is writing OUT; unlinked while held, as output_lock does
            if os.path.samestat(os.fstat(fd), os.stat(lock_path)):
                remove_stale_temporaries(lock_path.with_name(lock_path.name[:-len(".lock")]))
                os.unlink(lock_path)
        except (BlockingIOError, FileNotFoundError):
            pass
        finally:
            os.close(fd)


def remove_stale_work_folders(parent: Path) -> None:
    """Remove the work folders in parent of conversions that were killed (SIGKILL, a crash):
    those whose owner.lock no process holds (or, killed before it was made, whose pid is dead)."""
    for folder in parent.glob(WORK_FOLDER_PREFIX + "*"):
        owner = re.fullmatch(re.escape(WORK_FOLDER_PREFIX) + r"(\d+)-.+", folder.name)
        if not owner or not folder.is_dir() or folder.is_symlink():
            continue  # not one of ours
        try:
            fd = os.open(folder / "owner.lock", os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            if not process_alive(int(owner[1])):
                shutil.rmtree(folder, ignore_errors=True)
            continue
        except OSError:
            continue  # someone else's, not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(folder, ignore_errors=True)  # a folder removed meanwhile by another cleaner: nothing
        except BlockingIOError:
            pass  # its conversion is running
        finally:
            os.close(fd)
