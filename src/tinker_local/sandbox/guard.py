"""In-process runner for sandboxed programs: installs a Python audit hook, then runs the program.

Passed as `python -I -S -c <this source> MAIN GUARD_JSON` by the launcher; never imported by
tinker_local. The hook is defence in depth, not the security boundary: in "namespace" mode the
kernel (namespaces, chroot, unprivileged uid, rlimits) enforces isolation; in "plain" mode this
hook is the only barrier against network and file access, and native code could bypass it,
which is why it also refuses to load ctypes. Denials raise PermissionError with a message
"sandbox: ... is not allowed" that the host side turns into a failure reason.
"""

import json
import os
import sys

_NETWORK_EVENTS = {
    "socket.__new__",
    "socket.bind",
    "socket.connect",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyaddr",
    "socket.sendto",
    "socket.sendmsg",
}
_PROCESS_EVENTS = {
    "os.system",
    "os.fork",
    "os.forkpty",
    "os.posix_spawn",
    "os.spawn",
    "os.exec",
    "subprocess.Popen",
    "pty.spawn",
}
# Events whose first argument is a path the program wants to change.
_WRITE_PATH_EVENTS = {
    "os.remove",
    "os.rmdir",
    "os.mkdir",
    "os.chmod",
    "os.chown",
    "os.truncate",
    "os.utime",
    "os.link",
    "os.symlink",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.move",
}
_LIST_EVENTS = {"os.listdir", "os.scandir"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _install(cfg: dict) -> None:
    # Bound now: a program may blank os functions (LiveCodeBench's reliability_guard sets
    # os.getcwd = None), and the hook must keep working for the rest of the run.
    realpath, join, getpid, getcwd = os.path.realpath, os.path.join, os.getpid, os.getcwd
    write_roots = [realpath(cfg["workdir"]), realpath(cfg["tmpdir"]), "/dev/null"]
    read_roots = write_roots + [realpath(p) for p in cfg["read_roots"]]
    allow_subprocess = bool(cfg["allow_subprocess"])

    def deny(what: str, event: str, error: type[Exception] = PermissionError) -> None:
        raise error(f"sandbox: {what} is not allowed ({event})")

    def inside(path: object, roots: list) -> bool:
        if isinstance(path, int) or path is None:
            return True  # an already-open descriptor, or the current folder
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        full = realpath(join(getcwd(), str(path)))
        return any(full == r or full.startswith(r.rstrip("/") + "/") for r in roots)

    def hook(event: str, args: tuple) -> None:
        if event in _NETWORK_EVENTS:
            deny("network access", event)
        elif event in _PROCESS_EVENTS and not allow_subprocess:
            deny("process creation", event)
        elif event in ("os.kill", "os.killpg") and args and args[0] != getpid():
            deny("signalling other processes", event)
        elif event in ("ctypes.dlopen", "ctypes.cdata"):
            deny("ctypes", event)
        elif event == "import" and args and args[0] in ("ctypes", "_ctypes"):
            # An ImportError: libraries that treat ctypes as optional (numpy) carry on without.
            deny("ctypes", event, ImportError)
        elif event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and mode is None and flags & _WRITE_FLAGS
            )
            if not inside(path, write_roots if writing else read_roots):
                deny(f"{'writing' if writing else 'reading'} {path!r}", event)
        elif event in _LIST_EVENTS and args and not inside(args[0], read_roots):
            deny(f"listing {args[0]!r}", event)
        elif event in _WRITE_PATH_EVENTS and args and not inside(args[0], write_roots):
            deny(f"changing {args[0]!r}", event)
        elif (
            event == "os.rename"
            and len(args) >= 2
            and not (inside(args[0], write_roots) and inside(args[1], write_roots))
        ):
            deny(f"moving {args[0]!r}", event)

    sys.addaudithook(hook)


def _main() -> None:
    main, cfg = sys.argv[1], json.loads(sys.argv[2])
    import runpy  # imported before the hook so its own file reads stay unaffected

    if cfg.get("enabled", True):
        _install(cfg)
    sys.argv = [main]
    sys.path.insert(0, os.getcwd())  # like `python main.py`: the program's folder is importable
    sys.path[1:1] = cfg.get("python_path", [])  # the installed packages the run may import
    runpy.run_path(main, run_name="__main__")


_main()
