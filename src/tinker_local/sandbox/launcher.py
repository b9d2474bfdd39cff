"""Child side of the sandbox: isolates itself, drops privileges, sets limits, execs Python.

Run by `runner.py` as `python -I -S launcher.py CONFIG_JSON` in a new session. Standard library
only, never imports tinker_local (it runs under the bare base interpreter).

Modes:
- "namespace" (root on Linux): new mount, network, PID, IPC and UTS namespaces. A tmpfs root
  holds read-only binds of /usr (and the interpreter's prefix), four device nodes, a tmpfs /tmp
  and a tmpfs /sandbox with the staged files. The program runs chrooted there as an unprivileged
  uid with no_new_privs. Its PID namespace's init is a small waiter; when the program exits (or
  the caller kills the session) the init exits and the kernel kills every process left in it.
- "plain": no namespaces. The program runs in the staging folder, as an unprivileged uid when
  we are root; the Python guard (guard.py) is then the only network/file barrier.
In both, when the host made a memory cgroup for the run, the launcher joins it before anything
else (`cgroup_procs`), so the program and all its children share one memory cap.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 1, 2, 4, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
SETUP_FAILED = 125  # exit code when the sandbox itself could not be set up
DEVICES = ("null", "zero", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = [None if s is None else s.encode() for s in (src, dst, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {dst}")


def _bind_readonly(src: str, dst: str, *, devices: bool = False) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    _mount(src, dst, None, MS_BIND | MS_REC, None)
    nodev = 0 if devices else MS_NODEV
    _mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | nodev, None)


def _build_root(cfg: dict) -> str:
    """Assemble the new root filesystem (in our private mount namespace) and stage the files."""
    root = os.path.join(cfg["staging"], "root")
    os.makedirs(root, exist_ok=True)
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)  # nothing we mount leaks to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID, "size=1m,mode=755")
    for top in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = "/" + top
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(root, top))
        elif os.path.isdir(host):
            _bind_readonly(host, os.path.join(root, top))
    for prefix in cfg["python_dirs"]:
        inside = os.path.join(root, prefix.lstrip("/"))
        if not os.path.exists(inside):  # already visible when it lives under /usr
            _bind_readonly(prefix, inside)
    for name in ("ld.so.cache", "localtime"):
        if os.path.exists("/etc/" + name):
            _bind_readonly(os.path.realpath("/etc/" + name), os.path.join(root, "etc", name))
    for dev in DEVICES:
        _bind_readonly("/dev/" + dev, os.path.join(root, "dev", dev), devices=True)
    for name, path in cfg.get("site_entries", []):  # installed packages the run may import
        _bind_readonly(path, os.path.join(root, "site", name))
    size = int(cfg["disk_bytes"])
    for mnt, mode in (("tmp", "1777"), ("sandbox", "755")):
        path = os.path.join(root, mnt)
        os.makedirs(path, exist_ok=True)
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={mode}")
    shutil.copytree(
        os.path.join(cfg["staging"], "files"), os.path.join(root, "sandbox"), dirs_exist_ok=True
    )
    _chown_tree(os.path.join(root, "sandbox"), cfg["uid"], cfg["gid"])
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID, None)
    return root


def _chown_tree(path: str, uid: int | None, gid: int | None) -> None:
    if uid is None:
        return
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            os.lchown(name, uid, gid)


def _drop_privileges(cfg: dict) -> None:
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])


def _cap(which: int, soft: int, hard: int | None = None) -> None:
    """Lower a limit; never above the current hard limit (only root could raise that)."""
    current = resource.getrlimit(which)[1]
    hard = soft if hard is None else hard
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


def _set_limits(cfg: dict) -> None:
    lim = cfg["limits"]
    cpu = int(lim["cpu_s"])
    _cap(resource.RLIMIT_CPU, cpu, cpu + 1)  # SIGXCPU first, SIGKILL a second later
    _cap(resource.RLIMIT_AS, lim["memory_bytes"])
    _cap(resource.RLIMIT_FSIZE, lim["file_size_bytes"])
    _cap(resource.RLIMIT_NPROC, lim["nproc"])
    _cap(resource.RLIMIT_NOFILE, 256)
    _cap(resource.RLIMIT_CORE, 0)
    os.nice(int(cfg["nice"]))


def _exec_program(cfg: dict, workdir: str, tmpdir: str) -> None:
    env = {
        "HOME": workdir,
        "TMPDIR": tmpdir,
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        # One thread per math library: the run's process cap (RLIMIT_NPROC) counts threads,
        # and an allowed numpy would otherwise start one BLAS thread per host core.
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    }
    guard = dict(cfg["guard"], workdir=workdir, tmpdir=tmpdir)
    py = cfg["python"]
    argv = [
        py,
        "-I",
        "-S",
        "-B",
        "-X",
        "utf8",
        "-c",
        cfg["runner_source"],
        cfg["main"],
        json.dumps(guard),
    ]
    os.execve(py, argv, env)


def _write_status(cfg: dict, status: int) -> None:
    info = {
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
    }
    with open(os.path.join(cfg["staging"], "status.json"), "w") as f:
        json.dump(info, f)


def _namespace_main(cfg: dict) -> int:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    _check(_libc.unshare(flags), "unshare")
    init = os.fork()  # first child is PID 1 of the new PID namespace
    if init:
        _, status = os.waitpid(init, 0)
        return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    try:
        root = _build_root(cfg)
        program = os.fork()
        if program == 0:
            try:
                os.chroot(root)
                os.chdir("/sandbox")
                _drop_privileges(cfg)
                _set_limits(cfg)
                _exec_program(cfg, "/sandbox", "/tmp")
            except BaseException as exc:  # noqa: BLE001 - report any setup failure, then exit
                sys.stderr.write(f"sandbox setup failed: {exc!r}\n")
            os._exit(SETUP_FAILED)
        _, status = os.waitpid(program, 0)
        _write_status(cfg, status)
        # Exiting PID 1 makes the kernel SIGKILL everything the program left behind.
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    except BaseException as exc:  # noqa: BLE001
        sys.stderr.write(f"sandbox setup failed: {exc!r}\n")
        sys.stderr.flush()
        os._exit(SETUP_FAILED)


def _plain_main(cfg: dict) -> int:
    workdir = os.path.join(cfg["staging"], "files")
    tmpdir = os.path.join(cfg["staging"], "tmp")
    os.makedirs(tmpdir, exist_ok=True)
    _chown_tree(workdir, cfg["uid"], cfg["gid"])
    _chown_tree(tmpdir, cfg["uid"], cfg["gid"])
    os.chdir(workdir)
    _drop_privileges(cfg)
    _set_limits(cfg)
    _exec_program(cfg, workdir, tmpdir)
    return SETUP_FAILED  # not reached


def _join_cgroup(cfg: dict) -> None:
    """Enter the run's memory cgroup first, so everything started from here is capped."""
    if cfg.get("cgroup_procs"):
        with open(cfg["cgroup_procs"], "w") as f:
            f.write(str(os.getpid()))


def main() -> int:
    os.umask(0o022)
    cfg = json.loads(sys.argv[1])
    try:
        _join_cgroup(cfg)
        if cfg["mode"] == "namespace":
            return _namespace_main(cfg)
        return _plain_main(cfg)
    except BaseException as exc:  # noqa: BLE001
        sys.stderr.write(f"sandbox setup failed: {exc!r}\n")
        return SETUP_FAILED


if __name__ == "__main__":
    sys.exit(main())
