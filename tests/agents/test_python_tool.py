"""The sandboxed `python` tool: output, and each limit hit (memory, CPU, wall time, network) as an error
observation through the runner, the run going on."""

from __future__ import annotations

import socket
import sys
import threading

import pytest

from longstraw.agents.python_tool import network_isolation, python_tool, run_python
from longstraw.agents.tools import ToolCall, ToolRegistry, ToolRunner

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the python tool's limits are Linux's")


@pytest.fixture(scope="module")
def runner():
    tools = ToolRegistry([python_tool(cpu_seconds=2, memory_mb=256, wall_seconds=20)])
    return ToolRunner(tools)


def py(runner, code: str):
    return runner.run([[ToolCall("python", {"code": code})]])[0][0]


def test_output_and_the_codes_own_error(runner):
    ok = py(runner, "import math\nprint(math.factorial(10))")
    assert (ok.content, ok.error) == ("3628800\n", False)
    raised = py(runner, "print('before')\nraise ValueError('bad input')")
    assert not raised.error  # the code's own exception is output the model reads, not a tool fault
    assert raised.content.startswith("before\n[stderr]\nTraceback") and "ValueError: bad input" in raised.content
    assert 'File "<python tool>", line 2' in raised.content and '"<string>"' not in raised.content  # no bootstrap


def test_output_is_cut():
    assert run_python("print('x' * 100)", max_chars=10) == "x" * 10 + "\n[... 91 more characters cut]"
    # a flood is read to its end but not kept
    flood = run_python("import sys\nfor _ in range(200):\n    sys.stdout.write('y' * 100_000)", max_chars=10)
    assert flood == "y" * 10 + "\n[... cut: 20000000 bytes of output in all]"


def test_memory_limit(runner):
    over = py(runner, "block = bytearray(1024 * 1024 * 1024)\nprint('allocated')")
    assert over.error and over.content == "error: python: ran out of memory at its limit of 256 MB"
    assert py(runner, "print('still here')").content == "still here\n"


def test_cpu_limit():
    runner = ToolRunner(ToolRegistry([python_tool(cpu_seconds=1, wall_seconds=120)]))
    spin = py(runner, "while True:\n    pass")
    assert spin.error and spin.content == "error: python: stopped at its CPU-time limit of 1 s"


def test_wall_limit():
    tools = ToolRegistry([python_tool(wall_seconds=1)])
    # sleeping uses no CPU: only the wall-time limit stops it
    result = ToolRunner(tools).run([[ToolCall("python", {"code": "import time\ntime.sleep(60)"})]])[0][0]
    assert result.error and result.content == "error: python: stopped at its wall-time limit of 1 s"


@pytest.fixture
def listener():
    """A TCP server on this machine's loopback that records whether anyone connected."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(60)
    connected = threading.Event()

    def accept():
        try:
            server.accept()[0].close()
            connected.set()
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    yield port, connected
    if not connected.is_set():  # closing a socket does not wake a thread blocked in accept(): connect to it
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    thread.join()
    server.close()


CONNECT = "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=5)\nprint('connected')"


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "audit-hook"])
def test_network_is_refused(runner, listener, namespaces):
    port, connected = listener
    tools = ToolRegistry([python_tool(wall_seconds=20, namespaces=namespaces)])
    result = ToolRunner(tools).run([[ToolCall("python", {"code": CONNECT.format(port=port)})]])[0][0]
    assert result.error and result.content == "error: python: network access is disabled in this tool"
    assert not connected.is_set()


def test_network_namespace_blocks_below_python(listener):
    # a connection made past the audit hook (a raw syscall through ctypes' libc) meets the empty namespace
    if network_isolation() != "netns":
        pytest.skip("user namespaces are not allowed here; only the audit hook holds")
    port, connected = listener
    code = ("import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "fd = libc.socket(2, 1, 0)\n"
            f"addr = struct.pack('!HH4s8x', 2, {port}, bytes([127, 0, 0, 1]))\n"
            "addr = struct.pack('=H', 2) + addr[2:]\n"
            "print('fd', fd >= 0, 'connect', libc.connect(fd, addr, 16), 'errno', ctypes.get_errno())")
    out = run_python(code)
    assert out.startswith("fd True connect -1 errno ") and not connected.is_set()
