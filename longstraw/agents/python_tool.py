"""The `python` tool: runs the model's code in a fresh Python subprocess under limits, without network.

What is enforced, without root, on Linux:
- CPU time: RLIMIT_CPU (the kernel stops the process at the limit).
- Memory: RLIMIT_AS, the address space (an allocation past it fails; Python raises MemoryError).
- Wall time: the parent kills the child's whole process group at the limit.
- Network: the child first moves itself into new user and network namespaces (unshare(CLONE_NEWUSER |
  CLONE_NEWNET), allowed unprivileged where the kernel enables user namespaces, as on most distributions). There
  it and every process it starts see only a loopback device that is down: no connection of any kind leaves, and
  this is kernel-enforced. Where namespaces are refused, the child falls back to an audit hook (PEP 578) that
  refuses creating non-Unix sockets, name lookups, starting processes and loading C libraries through ctypes: this
  stops Python-level network use, but it is not a sandbox against code that sets out to escape (an already
  imported C extension can still open sockets). `network_isolation()` tells which one holds on this machine.
In both cases Python-level socket creation is refused as well, so network use is reported as such to the model.
The code runs as the same user (its file permissions apply: the filesystem is neither hidden nor read-only, so run
the trainer as an unprivileged user, never as root), in a temporary working directory removed afterwards. Output is
read to its end but only its start is kept.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import threading

from .tools import Tool, ToolError

# exit codes the bootstrap uses to tell a limit hit from the code's own failure
_EXIT_MEMORY, _EXIT_NETWORK = 97, 98

_BOOTSTRAP = r"""
import ctypes, os, resource, socket, sys
cpu, memory, path, namespaces = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
# CLONE_NEWUSER | CLONE_NEWNET
isolated = namespaces and ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) == 0
print("netns" if isolated else "audit", file=sys.stderr, flush=True)
class NetworkDisabled(PermissionError):
    pass
BLOCKED = ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex", "socket.gethostbyaddr")
PROCESS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
           "ctypes.dlopen", "ctypes.dlsym", "pty.spawn")
def hook(event, args):
    if event == "socket.__new__" and args[1] != socket.AF_UNIX or event in BLOCKED:
        raise NetworkDisabled("network access is disabled in the python tool")
    if not isolated and event in PROCESS:
        raise PermissionError(f"{event} is disabled in the python tool")
sys.addaudithook(hook)
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
code = open(path, encoding="utf-8").read()
sys.argv = ["<python tool>"]
try:
    exec(compile(code, "<python tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except NetworkDisabled:
    os._exit(%d)
except MemoryError:
    os._exit(%d)
except SystemExit:
    raise
except BaseException as e:  # the traceback from the code's own frames on, without this bootstrap's
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
""" % (_EXIT_NETWORK, _EXIT_MEMORY)


class _CappedPipe:
    """Reads a pipe to its end in a thread and keeps its first `limit` bytes: code that floods its output costs the
    trainer no memory, and the child never blocks on a full pipe."""

    def __init__(self, stream, limit: int):
        self.kept, self.total = bytearray(), 0
        self._thread = threading.Thread(target=self._read, args=(stream, limit), daemon=True)
        self._thread.start()

    def _read(self, stream, limit: int) -> None:
        with stream:
            while chunk := os.read(stream.fileno(), 1 << 16):
                self.total += len(chunk)
                if len(self.kept) < limit:
                    self.kept += chunk[: limit - len(self.kept)]

    def text(self, max_chars: int, skip_first_line: bool = False) -> str:
        # a process the child started in its own session may hold the pipe open: keep what came so far
        self._thread.join(timeout=5)
        text = self.kept.decode("utf-8", errors="replace")
        if skip_first_line:
            text = text.partition("\n")[2]
        if self.total > len(self.kept):
            return text[:max_chars] + f"\n[... cut: {self.total} bytes of output in all]"
        if len(text) > max_chars:
            return text[:max_chars] + f"\n[... {len(text) - max_chars} more characters cut]"
        return text


def run_python(code: str, *, cpu_seconds: int = 5, memory_mb: int = 512, wall_seconds: float = 10.0,
               max_chars: int = 4000, namespaces: bool = True) -> str:
    """Run `code` and return its stdout (and stderr, after a "[stderr]" line), each cut to `max_chars`. A limit hit
    or network use raises ToolError, which the runner turns into an error observation; the code's own exception is
    output like any other (its traceback on stderr). `namespaces=False` skips the network namespace and relies on
    the audit hook alone."""
    with tempfile.TemporaryDirectory(prefix="longstraw-python-") as workdir:
        path = os.path.join(workdir, "code.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(code)
        command = [sys.executable, "-I", "-c", _BOOTSTRAP, str(cpu_seconds), str(memory_mb << 20), path,
                   "1" if namespaces else "0"]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        keep = 4 * max_chars + (1 << 16)  # bytes: room for max_chars characters of any UTF-8
        out, err = _CappedPipe(proc.stdout, keep), _CappedPipe(proc.stderr, keep)
        try:
            proc.wait(timeout=wall_seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise ToolError(f"python: stopped at its wall-time limit of {wall_seconds:g} s") from None
    stdout = out.text(max_chars)
    stderr = err.text(max_chars, skip_first_line=True)  # the first line is the isolation mode
    if proc.returncode == _EXIT_MEMORY:
        raise ToolError(f"python: ran out of memory at its limit of {memory_mb} MB")
    if proc.returncode == _EXIT_NETWORK:
        raise ToolError("python: network access is disabled in this tool")
    if proc.returncode == -signal.SIGXCPU or proc.returncode == -signal.SIGKILL:
        raise ToolError(f"python: stopped at its CPU-time limit of {cpu_seconds} s")
    text = stdout
    if stderr:
        text += ("\n" if text and not text.endswith("\n") else "") + "[stderr]\n" + stderr
    if proc.returncode != 0 and not stderr:
        text += f"\n[exit status {proc.returncode}]"
    return text


@functools.cache
def network_isolation() -> str:
    """"netns" where the child gets its own network namespace (kernel-enforced), "audit" where only the audit
    hook holds."""
    with tempfile.TemporaryDirectory(prefix="longstraw-python-") as workdir:
        path = os.path.join(workdir, "code.py")
        open(path, "w").close()
        proc = subprocess.run([sys.executable, "-I", "-c", _BOOTSTRAP, "5", str(512 << 20), path, "1"], cwd=workdir,
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    return proc.stderr.decode().split("\n", 1)[0].strip()


def python_tool(*, cpu_seconds: int = 5, memory_mb: int = 512, wall_seconds: float = 10.0,
                max_chars: int = 4000, namespaces: bool = True) -> Tool:
    """The `python` tool with these limits (see the module's docstring for what is guaranteed)."""
    if cpu_seconds < 1 or memory_mb < 64 or wall_seconds <= 0:
        raise ValueError(f"python tool limits: cpu_seconds >= 1, memory_mb >= 64 (the interpreter needs some) and "
                         f"wall_seconds > 0, got {cpu_seconds}, {memory_mb}, {wall_seconds}")

    def python(code: str) -> str:
        return run_python(code, cpu_seconds=cpu_seconds, memory_mb=memory_mb, wall_seconds=wall_seconds,
                          max_chars=max_chars, namespaces=namespaces)

    parameters = {"type": "object", "required": ["code"],
                  "properties": {"code": {"type": "string", "description": "Python source; print what you need."}}}
    description = ("Run Python code in a fresh interpreter and return what it prints (stdout, then stderr). "
                   f"Limits: {cpu_seconds} s CPU, {memory_mb} MB memory, {wall_seconds:g} s, no network.")
    # the runner's timeout must not stop the call before the tool's own wall limit does
    return Tool("python", python, description, parameters, timeout=wall_seconds + 5.0)

