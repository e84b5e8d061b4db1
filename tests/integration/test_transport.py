"""Weight transports between real processes: safetensors on disk, and a gloo broadcast."""

import multiprocessing as mp
import socket
import time

import torch

from relayrl.weights.transport import DiskReceiver, DiskSender, DistReceiver, DistSender


def named(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [("a.weight", torch.randn(3, 4, generator=g)), ("b.bias", torch.randn(5, generator=g))]


def test_disk_transport_versions_atomic_and_rotated(tmp_path):
    got = []
    sender = DiskSender(tmp_path / "w", keep=2)
    receiver = DiskReceiver(tmp_path / "w", lambda ts, v: got.append((v, dict(ts))), poll_s=0.05)
    try:
        for v in (1, 2, 3):
            sender.send(named(v), v)
            deadline = time.time() + 5
            while (not got or got[-1][0] != v) and time.time() < deadline:
                time.sleep(0.02)
        assert [v for v, _ in got][-1] == 3 and all(a < b for (a, _), (b, _) in zip(got, got[1:]))
        assert torch.equal(got[-1][1]["a.weight"], named(3)[0][1])
        assert sorted(p.name for p in (tmp_path / "w").glob("v*")) == ["v2", "v3"]  # older ones rotated
        assert (tmp_path / "w" / "LATEST").read_text().strip() == "3"
        assert not list((tmp_path / "w").glob(".v*"))  # no temp folders left
    finally:
        receiver.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _receive(address, out):
    got = []
    r = DistReceiver(address, named(0), lambda ts, v: got.append((v, [t.clone() for _, t in ts])))
    r.close()  # returns when the sender closes
    out.put([(v, [t.tolist() for t in ts]) for v, ts in got])


def test_dist_broadcast_between_processes():
    address = f"127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receive, args=(address, out))
    proc.start()
    sender = DistSender(address)
    for v in (1, 2):
        sender.send(named(v), v)
    sender.close()
    got = out.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 0
    assert [v for v, _ in got] == [1, 2]
    assert torch.equal(torch.tensor(got[1][1][0]), named(2)[0][1])
