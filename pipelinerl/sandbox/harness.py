# The sandbox's child side, a program of its own (pipelinerl/sandbox/__init__.py starts it; its docstring says
# how a run works). Runs as `python -I -S -B -X utf8 -c HARNESS`, HARNESS being this file's text (no site: its
# .pth files cost ~15 ms of a ~25 ms start here; the site directories are put on sys.path directly), as root when
# the caller is root. Kept to modules that are built in or already loaded, because every import is paid by every
# run. Not a module to import: it reads its settings from fd 0 and runs the program.

if __name__ != "__main__":
    raise ImportError("pipelinerl/sandbox/harness.py is the sandbox's child program, not a module to import")

import marshal
import os
import sys


def _read_exact(n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(0, n - len(buf))
        if not chunk:
            raise EOFError("sandbox settings cut short")
        buf += chunk
    return bytes(buf)

_cfg = marshal.loads(_read_exact(int.from_bytes(_read_exact(8), "little")))
_status_fd, _lifeline_fd, _codes = _cfg["status_fd"], _cfg["lifeline_fd"], _cfg["exit_codes"]

def _reachable_by_nobody(path):
    # a fresh uid with no groups gets the "other" bits only: every directory up to / must let it through
    try:
        mode = os.stat(path).st_mode
        if mode & (0o005 if os.path.isdir(path) else 0o004) == 0:
            return False
        while path != "/":
            path = os.path.dirname(path)
            if not os.stat(path).st_mode & 0o001:
                return False
    except OSError:
        return False
    return True

def _reach_through_fds(hidden):
    # Directories the sandbox user could not reach (e.g. the standard library under a 0700 /root), and those the
    # private tmpfs is about to cover (`hidden`: a checkout's venv under /tmp), stay importable through a directory
    # fd opened now: /proc/self/fd/N skips the path's ancestors and outlives the mount over them.
    mapping = {}
    for p in sys.path:
        covered = any(p == h or p.startswith(h + "/") for h in hidden)
        if p and p not in mapping and os.path.isdir(p) and (covered or not _reachable_by_nobody(p)):
            mapping[p] = f"/proc/self/fd/{os.open(p, os.O_RDONLY | os.O_DIRECTORY)}"
    def remap(p):
        for old in sorted(mapping, key=len, reverse=True):
            if p == old or p.startswith(old + "/"):
                return mapping[old] + p[len(old):]
        return p
    sys.path[:] = [remap(p) for p in sys.path if p in mapping or _reachable_by_nobody(p)]
    for module in list(sys.modules.values()):
        search = getattr(module, "__path__", None)
        if isinstance(search, list):
            search[:] = [remap(p) for p in search]

def _count_my_tasks():
    # RLIMIT_NPROC counts every task of the real uid machine-wide; a shared uid starts with some already
    me, total = str(os.getuid()), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except (OSError, ValueError):
                continue
            if fields.get("Uid", "").split()[:1] == [me]:
                total += int(fields.get("Threads", "1"))
    return total

def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass

def _on_cpu_limit(signum, frame):
    _flush()
    os._exit(_codes["cpu"])

def _watch_caller():
    # nothing is ever written to the lifeline: EOF means the caller died, and nobody else will end this run
    try:
        while os.read(_lifeline_fd, 1):
            pass
    except OSError:
        return  # the program closed the fd: it gave up this protection for itself
    os._exit(_codes["orphaned"])

try:
    import _signal
    import _sitebuiltins
    import _thread
    import builtins
    import resource
    _uid, _workdir = _cfg["uid"], _cfg["workdir"]
    if _cfg["mounts"] or _uid >= 0:
        import ctypes
        _libc = ctypes.CDLL(None, use_errno=True)
        def _check(ret, what):
            if ret != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"{what}: {os.strerror(err)}")
        if _cfg["mounts"] and os.readlink("/proc/self/ns/mnt") == _cfg["caller_mount_ns"]:
            raise RuntimeError("refusing to mount tmpfs: not in a mount namespace of its own")
        sys.path += _cfg["site_dirs"]
        _reach_through_fds([os.path.realpath(target) for target, _ in _cfg["mounts"]])  # before the mounts
        for target, options in _cfg["mounts"]:
            if os.path.isdir(target):  # MS_NOSUID | MS_NODEV
                _check(_libc.mount(b"tmpfs", target.encode(), b"tmpfs", 6, options.encode()), "mount " + target)
    else:
        sys.path += _cfg["site_dirs"]
    if _uid >= 0:
        os.setgroups([])
        os.setresgid(_uid, _uid, _uid)
        os.setresuid(_uid, _uid, _uid)
        _check(_libc.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        if _cfg["seccomp"]:  # before any thread starts: threads inherit it
            class _Prog(ctypes.Structure):
                _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
            _filter = ctypes.create_string_buffer(_cfg["seccomp"], len(_cfg["seccomp"]))
            _prog = _Prog(len(_cfg["seccomp"]) // 8, ctypes.cast(_filter, ctypes.c_void_p))
            _check(_libc.prctl(22, 2, ctypes.byref(_prog), 0, 0), "prctl(PR_SET_SECCOMP)")
    sys.path.insert(0, _workdir)  # the program's own modules (`files`) first, as for `python main.py`
    os.chdir(_workdir)
    for _name, _text in _cfg["files"].items():
        if os.path.dirname(_name):
            os.makedirs(os.path.dirname(_name), exist_ok=True)
        with open(_name, "w", encoding="utf-8", errors="surrogateescape") as _f:
            _f.write(_text)
    _path = os.path.join(_workdir, _cfg["main"])
    _source, _argv = _cfg["files"][_cfg["main"]], _cfg["argv"]
    builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")  # what `site` would have added
    builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
    _signal.signal(_signal.SIGXCPU, _on_cpu_limit)
    _thread.stack_size(65536)
    _thread.start_new_thread(_watch_caller, ())
    _thread.stack_size(0)
    _nproc = _cfg["nproc"] + (_count_my_tasks() if _cfg["nproc_relative"] else 0)
    for _res, _soft in _cfg["rlimits"] + [(resource.RLIMIT_NPROC, _nproc)]:
        _held = resource.getrlimit(_res)[1]  # only root may raise a hard limit: never ask for more
        _hard = _soft + 1 if _res == resource.RLIMIT_CPU else _soft  # CPU: SIGXCPU, then SIGKILL a second later
        if _held != resource.RLIM_INFINITY:
            _soft, _hard = min(_soft, _held), min(_hard, _held)
        resource.setrlimit(_res, (_soft, _hard))
except BaseException as e:
    os.write(_status_fd, f"{type(e).__name__}: {e}".encode("utf-8", "replace"))
    os._exit(_codes["setup"])
del _cfg
os.write(_status_fd, b"ok")
os.close(_status_fd)
_main = type(sys)("__main__")
_main.__file__, _main.__builtins__ = _path, builtins
sys.modules["__main__"] = _main
sys.argv = [_path] + _argv
try:
    exec(compile(_source, _path, "exec"), _main.__dict__)
except SystemExit:
    raise
except BaseException as e:
    _tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # not the harness's own frame
    try:
        sys.excepthook(type(e), e.with_traceback(_tb), _tb)
    except BaseException:
        pass
    if isinstance(e, MemoryError):
        _flush()
        os._exit(_codes["memory"])
    sys.exit(1)
