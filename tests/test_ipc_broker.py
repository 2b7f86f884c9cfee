"""gpupoold's CUDA IPC broker (gpupoold/workers/ipc_broker.py; issue 37, item 4): an exported
allocation's fd goes only to a session of the exporter's token, with the handle's secret, on the
server that made it; a session's fds close when it ends."""

from __future__ import annotations

import os
from pathlib import Path

import gpupool_protocol as gp
import pytest

from gpupoold.workers.ipc_broker import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    HANDLE_SIZE,
    IpcBroker,
    IpcHandle,
    IpcRefused,
    answer,
)

TOKENS = {1: "job-a", 2: "job-a", 3: "job-b"}  # sessions 1 and 2 are one job's processes


def exported_file(tmp_path: Path, name: str = "alloc") -> tuple[int, int]:
    """An fd standing in for a worker's exported allocation, and its inode."""
    path = tmp_path / name
    path.write_bytes(b"device memory")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    return fd, os.fstat(fd).st_ino


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_same_job_opens_what_it_exported(tmp_path: Path) -> None:
    broker = IpcBroker(TOKENS.get)
    fd, ino = exported_file(tmp_path)
    handle = broker.export(1, fd, size=4 << 20, offset=4096)
    raw = handle.pack()
    assert len(raw) == HANDLE_SIZE
    got, size = broker.open(2, IpcHandle.unpack(raw))
    try:
        assert os.fstat(got).st_ino == ino and got != fd
        assert size == 4 << 20
    finally:
        os.close(got)
    assert IpcHandle.unpack(raw).offset == 4096
    broker.close()


def test_another_token_a_wrong_secret_or_server_is_refused(tmp_path: Path) -> None:
    broker = IpcBroker(TOKENS.get)
    fd, _ = exported_file(tmp_path)
    handle = broker.export(1, fd, size=2 << 20)
    forged = [
        (3, handle),  # another tenant with the genuine 64 bytes
        (2, IpcHandle(handle.handle_id, bytes(16), handle.size, 0, handle.server)),
        (2, IpcHandle(handle.handle_id + 1, handle.secret, handle.size, 0, handle.server)),
        (2, IpcHandle(handle.handle_id, handle.secret, handle.size, 0, b"elsewher")),
        (2, IpcHandle(handle.handle_id, handle.secret, handle.size, 2 << 20, handle.server)),
        (2, IpcHandle(handle.handle_id, handle.secret, 64 << 20, 0, handle.server)),  # size
        (9, handle),  # a session that is not running here
    ]
    for session, h in forged:
        with pytest.raises(IpcRefused) as err:
            broker.open(session, h)
        assert err.value.code == CUDA_ERROR_INVALID_VALUE
    with pytest.raises(IpcRefused, match="not a CUDA IPC handle"):
        IpcHandle.unpack(b"\x01" * HANDLE_SIZE)
    # another broker (another server, or the next gpupoold) does not know the handle
    with pytest.raises(IpcRefused, match="another server"):
        IpcBroker(TOKENS.get).open(2, handle)
    broker.close()


def test_a_session_end_closes_its_fds_and_its_handles(tmp_path: Path) -> None:
    broker = IpcBroker(TOKENS.get)
    fd1, _ = exported_file(tmp_path, "a")
    fd2, _ = exported_file(tmp_path, "b")
    h1 = broker.export(1, fd1, size=2 << 20)
    broker.export(2, fd2, size=2 << 20)
    got, _ = broker.open(2, h1)
    os.close(got)
    # session 2 may still map session 1's memory: the daemon ends it before scrubbing that GPU
    assert broker.session_ended(1) == {2}
    assert not is_open(fd1) and is_open(fd2) and len(broker) == 1
    with pytest.raises(IpcRefused, match="ended"):
        broker.open(2, h1)
    assert broker.session_ended(2) == set()  # nobody opened session 2's export
    assert not is_open(fd2) and len(broker) == 0


def test_refused_exports_close_the_fd(tmp_path: Path) -> None:
    broker = IpcBroker(TOKENS.get, max_per_session=1)
    fd, _ = exported_file(tmp_path, "a")
    broker.export(1, fd, size=2 << 20)
    over, _ = exported_file(tmp_path, "b")
    with pytest.raises(IpcRefused) as err:
        broker.export(1, over, size=2 << 20)
    assert err.value.code == CUDA_ERROR_OUT_OF_MEMORY and not is_open(over)
    stranger, _ = exported_file(tmp_path, "c")
    with pytest.raises(IpcRefused, match="not running"):
        broker.export(9, stranger, size=2 << 20)
    assert not is_open(stranger)
    broker.close()


def test_answer_turns_worker_messages_into_the_broker_calls(tmp_path: Path) -> None:
    """ipc_broker.answer, as the supervisor calls it: the export's fd goes to the broker, the
    open answers a dup of it to a worker of the same job; a worker that names another session
    than the one it serves, or a daemon without a broker, is refused and the fd closed."""
    broker = IpcBroker(TOKENS.get)
    fd, ino = exported_file(tmp_path)
    msg, out = answer(broker, 1, gp.WorkerIpcExport(session_id=1, size=2 << 20, offset=0), [fd])
    assert isinstance(msg, gp.WorkerIpcExported) and msg.code == 0 and out is None
    assert len(broker) == 1
    msg2, got = answer(broker, 2, gp.WorkerIpcOpen(session_id=2, handle=msg.handle), [])
    assert isinstance(msg2, gp.WorkerIpcOpened) and msg2.code == 0 and msg2.size == 2 << 20
    assert got is not None
    try:
        assert os.fstat(got).st_ino == ino
    finally:
        os.close(got)
    msg3, none = answer(broker, 3, gp.WorkerIpcOpen(session_id=3, handle=msg.handle), [])
    assert msg3.code == CUDA_ERROR_INVALID_VALUE and none is None and "another token" in msg3.error

    claimed, _ = exported_file(tmp_path, "claimed")
    msg4, _ = answer(broker, 3, gp.WorkerIpcExport(session_id=1, size=2 << 20), [claimed])
    assert msg4.code == CUDA_ERROR_INVALID_VALUE and not is_open(claimed) and len(broker) == 1

    lonely, _ = exported_file(tmp_path, "lonely")
    msg5, _ = answer(None, 1, gp.WorkerIpcExport(session_id=1, size=2 << 20), [lonely])
    assert msg5.code == CUDA_ERROR_NOT_SUPPORTED and not is_open(lonely)
    broker.close()


def test_event_handles_go_to_the_same_job_only_and_carry_no_driver_bytes() -> None:
    """Issue 37, item 4, events: the worker's export_event gives the broker the driver's
    CUipcEventHandle; the program's handle (what answer returns) holds none of its bytes, opens
    only for a session of the exporter's token, and is not a memory handle (nor the reverse)."""
    broker = IpcBroker(TOKENS.get)
    driver = bytes(range(1, 65))  # the driver's handle: stands for the exporting process's event
    msg, out = answer(broker, 1, gp.WorkerIpcExportEvent(session_id=1, event=driver), [])
    assert isinstance(msg, gp.WorkerIpcExported) and msg.code == 0 and out is None
    program = bytes(msg.handle)
    assert len(program) == HANDLE_SIZE and driver[8:24] not in program
    opened, none = answer(broker, 2, gp.WorkerIpcOpenEvent(session_id=2, handle=program), [])
    assert isinstance(opened, gp.WorkerIpcEventOpened) and opened.code == 0 and none is None
    assert bytes(opened.event) == driver

    stranger, _ = answer(broker, 3, gp.WorkerIpcOpenEvent(session_id=3, handle=program), [])
    assert stranger.code == CUDA_ERROR_INVALID_VALUE and "another token" in stranger.error
    assert not any(bytes(stranger.event))
    forged = bytearray(program)
    forged[16] ^= 1  # a bit of the secret
    refused, _ = answer(broker, 2, gp.WorkerIpcOpenEvent(session_id=2, handle=bytes(forged)), [])
    assert refused.code == CUDA_ERROR_INVALID_VALUE
    as_memory, fd = answer(broker, 2, gp.WorkerIpcOpen(session_id=2, handle=program), [])
    assert as_memory.code == CUDA_ERROR_INVALID_VALUE and fd is None
    assert "not a CUDA IPC handle" in as_memory.error

    assert broker.session_ended(1) == set()  # an event's opener maps no memory of the exporter
    gone, _ = answer(broker, 2, gp.WorkerIpcOpenEvent(session_id=2, handle=program), [])
    assert gone.code == CUDA_ERROR_INVALID_VALUE and len(broker) == 0


def test_the_same_event_exported_again_keeps_its_handle_and_events_have_their_own_limit(
        tmp_path: Path) -> None:
    """Issue 37, item 4 (review): PyTorch exports an event per CUDA tensor it sends, mostly the
    same events again: those answer the handle they got (no new entry), distinct events count
    against their own limit, not memory's, and the refusal speaks of events."""
    broker = IpcBroker(TOKENS.get, max_per_session=1, max_events_per_session=2)
    first, second, third = (bytes([n]) * HANDLE_SIZE for n in (1, 2, 3))
    a = broker.export_event(1, first)
    for _ in range(10):
        assert broker.export_event(1, first) == a
    assert len(broker) == 1
    assert broker.export_event(2, first) != a  # another session's export is its own
    b = broker.export_event(1, second)
    assert b.handle_id != a.handle_id and len(broker) == 3
    with pytest.raises(IpcRefused) as err:
        broker.export_event(1, third)
    assert err.value.code == CUDA_ERROR_OUT_OF_MEMORY
    assert "interprocess events" in err.value.message
    assert "cuIpcCloseMemHandle" not in err.value.message
    fd, _ = exported_file(tmp_path)  # memory still has its own room
    broker.export(1, fd, size=2 << 20)
    over, _ = exported_file(tmp_path, "over")
    with pytest.raises(IpcRefused, match="cuIpcCloseMemHandle"):
        broker.export(1, over, size=2 << 20)

    broker.session_ended(1)  # a new session of the same id starts afresh
    assert broker.export_event(1, first) != a and broker.export_event(1, third)
    broker.close()
