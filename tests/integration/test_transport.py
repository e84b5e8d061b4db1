"""Weight transports between real processes: safetensors on disk, and a gloo broadcast."""

import time

import torch
from bounds import bound
from transport_for_tests import run_dist_pair

from relayrl.weights.transport import DiskReceiver, DiskSender, DistReceiver


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


def _receive(address, out):
    got = []
    r = DistReceiver(address, named(0), lambda ts, v: got.append((v, [t.clone() for _, t in ts])))
    r.close()  # returns when the sender closes
    out.put([(v, [t.tolist() for t in ts]) for v, ts in got])


def test_dist_broadcast_between_processes():
    def send(sender):
        for v in (1, 2):
            sender.send(named(v), v)

    got = run_dist_pair(_receive, send)
    assert [v for v, _ in got] == [1, 2]
    assert torch.equal(torch.tensor(got[1][1][0]), named(2)[0][1])


BIG = (2048, 2048)  # 16 MB in fp32: far more than a loopback socket buffers, so a blocking send would wait


def _big(seed: int) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.full(BIG, float(seed))), ("b", torch.arange(4.0) + seed)]


def _receive_slowly(address, out):
    """Applies version 1 for 2 s: version 2 cannot travel before that."""
    got = []

    def apply(ts, v):
        got.append((v, [(t[0, 0].item() if t.dim() == 2 else t.tolist(), tuple(t.shape)) for _, t in ts]))
        if v == 1:
            time.sleep(2.0)

    r = DistReceiver(address, _big(0), apply)
    r.close(timeout=60)
    out.put(got)


def test_dist_send_returns_before_the_weights_travel_and_sends_what_it_was_given():
    """The trainer's next step overlaps the transfer: send() returns while the receiver still holds up the
    broadcast, and the tensors changed in place right after (the next optimizer step) are not what arrives."""
    returned_s = []

    def send(sender):
        weights = _big(1)
        sender.send(weights, 1)
        for _, t in weights:  # "the next step" updates the same tensors in place
            t.copy_(torch.full_like(t, 2.0) if t.dim() == 2 else torch.arange(4.0) + 2)
        t0 = time.perf_counter()
        sender.send(weights, 2)  # waits for version 1 to be out (not applied), then returns at once
        returned_s.append(time.perf_counter() - t0)
        for _, t in weights:
            t.fill_(-1.0)

    got = run_dist_pair(_receive_slowly, send)
    assert returned_s[0] < bound(1.0), f"send blocked {returned_s[0]:.2f} s while the receiver was busy"
    assert got == [(1, [(1.0, BIG), ([1.0, 2.0, 3.0, 4.0], (4,))]), (2, [(2.0, BIG), ([2.0, 3.0, 4.0, 5.0], (4,))])]
