"""The notebook kernel's client: its channels wait for messages in slices (k3lab.kernelenv)."""

import asyncio
import time
from queue import Empty

import pytest
import zmq
import zmq.asyncio
from jupyter_client.session import Session

from k3lab import kernelenv


def _channel_class():
    return kernelenv.manager().client().shell_channel_class


def test_notebook_clients_wait_in_slices():
    client = kernelenv.manager().client()
    assert isinstance(client, kernelenv.client_class())
    for name in ("shell", "iopub", "stdin", "control"):
        channel = getattr(client, f"{name}_channel_class")
        assert channel.get_msg is _channel_class().get_msg, name
        assert channel.get_msg.__qualname__.startswith("client_class"), name


def test_a_sliced_wait_reads_what_arrives_and_times_out(monkeypatch):
    """A message sent after the wait began is read in its slice; with nothing sent, Empty comes
    at the timeout, not before and not a slice late."""
    monkeypatch.setattr(kernelenv, "POLL_SLICE_S", 0.05)
    channel_class = _channel_class()
    session = Session(key=b"k3lab")

    async def scenario():
        ctx = zmq.asyncio.Context()
        sync_ctx = zmq.Context()
        recv = ctx.socket(zmq.PAIR)
        port = recv.bind_to_random_port("tcp://127.0.0.1")
        send = sync_ctx.socket(zmq.PAIR)
        send.connect(f"tcp://127.0.0.1:{port}")
        channel = channel_class(recv, session)
        try:
            t0 = time.monotonic()
            with pytest.raises(Empty):
                await channel.get_msg(timeout=0.3)
            waited = time.monotonic() - t0
            assert 0.28 <= waited < 0.3 + 0.2, waited

            async def later():
                await asyncio.sleep(0.2)
                session.send(send, "kernel_info_reply", content={"status": "ok"})

            task = asyncio.ensure_future(later())
            msg = await channel.get_msg(timeout=5)
            await task
            assert msg["msg_type"] == "kernel_info_reply"
            assert msg["content"]["status"] == "ok"
        finally:
            send.close(0)
            recv.close(0)
            sync_ctx.term()
            ctx.term()

    asyncio.run(scenario())
